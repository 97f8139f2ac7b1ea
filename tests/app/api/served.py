"""A real `glassbox serve` server for the API's tests: uvicorn on a free loopback port, in a
thread, over any Engine; started when it says it is, stopped (and its thread joined) after."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from app.api.engine_queue import Ask, Engine, EngineQueue
from app.api.serve import uvicorn_config
from app.api.server import Limits, create_app
from engine.events import Event

START_S = 30.0  # a loaded CI machine may take a while to start a thread and bind


@dataclass(frozen=True)
class Served:
    base_url: str  # http://127.0.0.1:PORT/v1
    queue: EngineQueue


@contextmanager
def serving(engine: Engine, limits: Limits) -> Iterator[Served]:
    app = create_app(engine, limits)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))  # the OS picks a free port: no race with other tests
    port = listener.getsockname()[1]
    config = uvicorn_config(app, "127.0.0.1", port, limits, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="api-server", daemon=True
    )
    thread.start()
    try:
        wait_until(lambda: server.started, START_S, "the server to start")
        yield Served(f"http://127.0.0.1:{port}/v1", app.state.queue)
    finally:
        server.should_exit = True
        thread.join(timeout=START_S)
        listener.close()
        assert not thread.is_alive(), "the server's thread did not stop"


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll `condition` (every few ms) until true, or fail saying what was awaited."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class HeldEngine:
    """An engine whose every generation waits for `release` before it starts (or a cancel):
    a request that holds the model for as long as a test needs."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.release = threading.Event()
        self.started = threading.Event()
        self.calls: list[str] = []  # each generation's last message, in the order they ran
        self.clients: list[str] = []  # and the User-Agent that asked for it

    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def max_context(self) -> int:
        return self.engine.max_context

    def generate(self, ask: Ask) -> Iterator[Event]:
        self.calls.append(ask.messages[-1].content)
        self.clients.append(ask.client)
        self.started.set()
        assert self.release.wait(START_S), "a held generation was never released"
        return self.engine.generate(ask)

    def cancel(self) -> None:
        self.release.set()
        self.engine.cancel()
