"""The engine's side of the program, Qt-free: the typed wire, the jobs, the server loop, and
the transports it runs over (a child process through a pipe with shared arrays, or a thread
for tests)."""
