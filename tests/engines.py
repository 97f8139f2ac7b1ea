"""The shipped engine client and server over the in-memory transport, for the window's tests.

The same server loop and client as the app's engine process (app.server.engine_thread), on loaders
and sessions a test builds in place: no process to start, nothing to import by name.
"""

from __future__ import annotations

from app.client.engine_client import EngineClient
from app.server.engine_thread import EngineThread
from app.server.jobs import Loader, SessionFactory


def in_memory(loader: Loader, session_factory: SessionFactory | None = None) -> EngineClient:
    return EngineClient(EngineThread(loader, session_factory))
