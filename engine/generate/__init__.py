"""One reply as a generator of events: the session loop, sampling, fitting the context, a
teacher's pacing and the trace of a reply."""
