"""What the engine keeps on disk: the cache folder, and the lock that makes one build of a thing
at a time across processes."""
