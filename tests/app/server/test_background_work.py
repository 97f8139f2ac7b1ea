"""A session's background decode-step work (the static step's bucket recordings on a GPU)
stops when another model replaces it and when the engine quits."""

from __future__ import annotations

import queue

from app.server.engine_server import QUIT_JOIN_S, EngineServer
from app.server.wire import Load, Quit
from engine.settings import LoadRequest
from tests.app.engine_models import compiled_fast_session, loader_with_error


def test_replacing_the_model_and_quitting_stop_its_recordings():
    closed: list = []

    def session_with_recordings(loaded):
        session = compiled_fast_session(loaded)
        session.compiling.close = lambda timeout: closed.append((session, timeout))
        return session

    requests: queue.Queue = queue.Queue()
    server = EngineServer(lambda reply, weight: None, loader_with_error, session_with_recordings)
    for job in (1, 2):
        requests.put(Load(job, LoadRequest(spec="fake")))
    requests.put(Quit())
    loaded = []
    original = server.load

    def load(job, request):
        original(job, request)
        loaded.append(server.session)

    server.load = load
    server.serve(requests.get)
    first, second = loaded
    assert first is not second
    assert closed == [(first, 0), (second, QUIT_JOIN_S)]  # unloaded at once, then at quit
