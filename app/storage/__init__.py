"""Conversations kept on disk: the SQLite store, the recorder that writes a reply as it streams,
the terminal chat's log, and export."""
