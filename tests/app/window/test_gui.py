"""run_gui: a clear refusal without a display; otherwise a window that loads the asked model."""

from __future__ import annotations

import sys

import app.window.gui
from app.client.engine_client import EngineClient
from app.options import load_request
from app.window.gui import NO_DISPLAY, parse_args, run_gui
from engine.settings import LoadRequest
from tests.engines import in_memory
from tests.ui.fakes import FakeBackend


def test_without_a_display_it_says_so_and_returns_2(monkeypatch, capsys):
    monkeypatch.setattr(sys, "platform", "linux")
    for name in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    assert run_gui([]) == 2
    assert NO_DISPLAY in capsys.readouterr().err


def test_arguments_default_to_the_bundled_model():
    args = parse_args([])
    assert (args.model, args.device, args.dtype, args.precision) == (
        "bundled", "auto", "auto", "auto"
    )  # fmt: skip
    args = parse_args(["--model", "org/name", "--device", "cuda:1", "--dtype", "bfloat16",
                       "--precision", "exact"])  # fmt: skip
    assert load_request(args) == LoadRequest(
        spec="org/name", device="cuda:1", dtype="bfloat16", precision="exact"
    )


def test_the_window_loads_the_requested_model_and_quits_cleanly(qtbot, qapp, monkeypatch):
    backend = FakeBackend()
    workers: list[EngineClient] = []

    def make_worker(engine):
        assert engine == "spawned before the window"
        worker = in_memory(backend.load, backend.make_session)
        workers.append(worker)
        return worker

    def run_until_loaded(self) -> int:
        # The real exec() would mark the shared QApplication as quitting for later tests.
        qtbot.waitUntil(lambda: workers and workers[0].info is not None, timeout=5000)
        return 0

    monkeypatch.setattr(app.window.gui, "spawn_engine", lambda: "spawned before the window")
    monkeypatch.setattr(app.window.gui, "engine_backend", make_worker)
    monkeypatch.setattr(type(qapp), "exec", run_until_loaded)
    monkeypatch.setattr("app.logs.setup_logging", lambda: None)  # keep pytest's streams
    assert run_gui(["--model", "tiny", "--device", "cpu", "--dtype", "float32"]) == 0
    assert backend.requests == [LoadRequest("tiny", "cpu", "float32")]
    assert workers[0].info.name == "tiny"
    assert not workers[0].is_running()


def test_a_missing_x11_library_is_named_instead_of_qt_aborting(monkeypatch, capsys):
    import ctypes

    import app.window.gui

    def refuse(path, *args, **kwargs):
        raise OSError("libxcb-icccm.so.4: cannot open shared object file: No such file")

    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("DISPLAY", ":0")
    for name in ("WAYLAND_DISPLAY", "QT_QPA_PLATFORM"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    assert app.window.gui.x11_problem() is not None
    assert run_gui([]) == 2
    assert "libxcb-icccm.so.4 is missing" in capsys.readouterr().err
