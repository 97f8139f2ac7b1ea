"""A load that fails says why in one line; the log keeps a traceback only for the program's
own faults, not for what the user can act on (a wrong path, a cache folder they cannot write)."""

from __future__ import annotations

import logging

import pytest

from app.server.engine_server import EngineServer
from app.server.wire import LoadFailed
from engine.load.loaded import ModelLoadError
from engine.settings import LoadRequest


@pytest.mark.parametrize(
    ("error", "said", "traceback"),
    [
        (ModelLoadError("No model at /nope.gguf."), "No model at /nope.gguf.", False),
        (RuntimeError("a bug"), "RuntimeError: a bug", True),
    ],
)
def test_a_failed_load_is_said_and_logged_by_whose_it_is(caplog, error, said, traceback):
    def loader(request, progress=None):
        raise error

    replies: list = []
    session = lambda loaded: loaded  # noqa: E731 (never made: every load fails)
    server = EngineServer(lambda reply, weight: replies.append(reply), loader, session)
    with caplog.at_level(logging.WARNING, logger="app.server.engine_server"):
        server.load(1, LoadRequest(spec="x"))
    server.outbox.close()  # what was queued is sent
    (failed,) = [r for r in replies if isinstance(r, LoadFailed)]
    assert failed.message == said
    (record,) = [r for r in caplog.records if "loading 'x' failed" in r.getMessage()]
    assert (record.exc_info is not None) == traceback
