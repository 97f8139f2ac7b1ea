"""A main window wired to the shipped engine client and server (in memory), running fake sessions
instead of a model."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from PySide6.QtCore import QSettings

from app.client.engine_client import EngineClient
from app.window import assembly
from engine.settings import LoadRequest
from tests.app.process_check import no_engine_process_left  # noqa: F401 - autouse
from tests.engines import in_memory
from tests.models import make_tiny
from tests.ui.fakes import FakeBackend
from tests.ui.test_panels import model_info
from ui.main_window import MainWindow
from ui.panels.docks import InternalsView


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def qsettings(tmp_path) -> QSettings:
    """Window layout kept in a scratch file, never in the user's settings."""
    return QSettings(str(tmp_path / "glassbox.ini"), QSettings.Format.IniFormat)


@pytest.fixture
def make_window(qtbot, qsettings) -> Iterator[Callable[[FakeBackend], MainWindow]]:
    """Build a shown window whose worker has loaded the fake model "fake-135M"."""
    workers: list[EngineClient] = []

    def make(backend: FakeBackend) -> MainWindow:
        worker = in_memory(backend.load, backend.make_session)
        workers.append(worker)
        window = MainWindow(worker, settings=qsettings)
        qtbot.addWidget(window)
        window.show()
        qtbot.waitExposed(window)
        with qtbot.waitSignal(worker.loaded, timeout=5000):
            window.load_model(LoadRequest(spec="fake-135M"))
        qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
        return window

    yield make
    for worker in workers:
        worker.shutdown()


@pytest.fixture
def window(make_window, backend) -> MainWindow:
    return make_window(backend)


@pytest.fixture
def build(qtbot, tmp_path):
    """Assemble windows on one scratch database; each shuts down at the end of the test."""
    built = []

    def make(loader, session_factory=None, database=tmp_path / "chats.sqlite3"):
        worker = in_memory(loader, session_factory)
        settings = QSettings(str(tmp_path / "layout.ini"), QSettings.Format.IniFormat)
        parts = assembly.assemble(worker, database=database, settings=settings)
        qtbot.addWidget(parts.window)
        parts.window.show()
        with qtbot.waitSignal(worker.loaded, timeout=30000):
            parts.window.load_model(LoadRequest(spec="tiny"))
        qtbot.waitUntil(lambda: not worker.busy, timeout=10000)
        built.append(parts)
        return parts

    yield make
    for parts in built:
        parts.window.close()
        parts.shutdown()


@pytest.fixture
def tiny_loader(tokenizer):
    """A random-weight Llama with the bundled tokenizer and a 2048-token context."""

    def load(request, progress):
        progress("Ready", 1.0)
        return make_tiny(tokenizer, "llama")

    return load


@pytest.fixture
def view(qtbot) -> Iterator[InternalsView]:
    """The internals panels of a tiny model (two watched layers), each dock closed after."""
    internals = InternalsView()
    for dock in internals.docks.values():
        qtbot.addWidget(dock)
    internals.set_model(model_info())
    internals.set_watched_layers((0, 1))
    yield internals
    internals.timer.stop()
