"""The engine server in a thread of this process, over in-memory queues: the second transport.

The same server loop (app.server.engine_server) and the same client (app.client.engine_client) as
the app's engine process, without a process to spawn or messages to pickle: the tests run the
shipped path with loaders and sessions they build in place, and start in milliseconds. The queues
behave as the pipes do: messages in order, a writer held up while too much is unread (so the
engine still waits for a window that is behind), EOFError for the reader once the writer is
done.

Here the model shares the window's interpreter lock: fine for tests and tools, not for the
app (see app.server.engine_process).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Generic, TypeVar

from app.server.engine_server import EngineServer
from app.server.jobs import Loader, SessionFactory, default_loader, default_session_factory
from app.server.pipe import PIPE_BYTES
from app.server.wire import ALL_JOBS, Cancel, Quit, Reply, Request

log = logging.getLogger(__name__)

T = TypeVar("T")


class MemoryChannel(Generic[T]):
    """One direction of the in-memory transport; `capacity`: the weight a writer may have
    unread before it waits (None: never waits)."""

    def __init__(self, capacity: int | None = None) -> None:
        self._capacity = capacity
        self._items: deque[tuple[T, int]] = deque()
        self._weight = 0
        self._closed = False
        self._condition = threading.Condition()

    def put(self, item: T, weight: int = 0) -> None:
        """Queue `item`; OSError once the channel is closed (nobody reads it any more)."""
        with self._condition:
            while self._full() and not self._closed:
                self._condition.wait()
            if self._closed:
                raise OSError("the in-memory channel is closed")
            self._items.append((item, weight))
            self._weight += weight
            self._condition.notify_all()

    def get(self) -> T:
        """The next item, waiting for one; EOFError once closed and empty."""
        with self._condition:
            while not self._items and not self._closed:
                self._condition.wait()
            if not self._items:
                raise EOFError("the in-memory channel is closed")
            item, weight = self._items.popleft()
            self._weight -= weight
            self._condition.notify_all()
            return item

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify_all()

    def _full(self) -> bool:
        return self._capacity is not None and self._weight > self._capacity


class EngineThread:
    """An engine server on `loader` and `session_factory` in a thread of this process (an
    app.server.wire.Transport)."""

    def __init__(
        self, loader: Loader = default_loader, session_factory: SessionFactory | None = None
    ) -> None:
        self._loader = loader
        self._session_factory = session_factory or default_session_factory
        self._requests: MemoryChannel[Request] = MemoryChannel()
        self._replies: MemoryChannel[Reply] = MemoryChannel(PIPE_BYTES)
        self.server = EngineServer(self._replies.put, loader, self._session_factory)
        self._thread = threading.Thread(target=self._serve, name="glassbox-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            self.server.serve(self._requests.get)
        finally:
            self._replies.close()  # the client's reader ends, as at a pipe's end

    def send(self, request: Request) -> bool:
        try:
            self._requests.put(request)
        except OSError:
            return False
        return True

    def receive(self) -> tuple[Reply, int]:
        return self._replies.get(), 0

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def why_stopped(self) -> str:
        return "The engine's thread ended unexpectedly"

    def stop(self, timeout_s: float, patient: bool = True) -> None:
        self.send(Cancel(ALL_JOBS))
        self.send(Quit())
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # a load cannot be interrupted, and a thread not killed
            log.warning("waiting for the engine's thread to finish its current job")
            self._thread.join()

    def close(self) -> None:
        self._requests.close()
        self._replies.close()

    def again(self) -> EngineThread:
        return EngineThread(self._loader, self._session_factory)
