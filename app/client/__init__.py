"""The window's side of the engine: the client that talks to the engine process, and the
time-sliced delivery of its events to the GUI thread."""
