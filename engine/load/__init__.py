"""A LoadRequest to a LoadedModel: the route for each kind of source, and the child process
that builds the compiled step."""
