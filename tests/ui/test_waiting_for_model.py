"""A message typed while the first model loads waits, visibly, and is answered once it is ready."""

from __future__ import annotations

import threading

from PySide6.QtCore import Qt

from engine.events import Finished
from engine.settings import LoadRequest, Message
from tests.engines import in_memory
from tests.ui.fakes import REPLY, FakeBackend
from ui.main_window import WAITING, MainWindow


def slow_window(qtbot, qsettings, backend: FakeBackend, release: threading.Event, spec="fake"):
    """A window whose first load ends when `release` is set (and fails for spec "broken")."""

    def load(request, progress):
        release.wait(10)
        return backend.load(request, progress)

    worker = in_memory(load, backend.make_session)
    window = MainWindow(worker, settings=qsettings)
    qtbot.addWidget(window)
    window.show()
    window.load_model(LoadRequest(spec=spec))
    return window, worker


def test_a_message_sent_while_loading_is_answered_when_the_model_is_ready(qtbot, qsettings):
    backend, release = FakeBackend(), threading.Event()
    window, worker = slow_window(qtbot, qsettings, backend, release)
    events: list = []
    window.events_received.connect(events.extend)
    try:
        assert window.info is None and worker.busy
        window.input.setPlainText("Are you there?")
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
        assert window.conversation() == [Message("user", "Are you there?")]
        assert WAITING in window.chat.toPlainText()  # the waiting state is visible
        assert window.statusBar().currentMessage() == WAITING
        assert not window.send_action.isEnabled() and window.stop_action.isEnabled()
        assert not window.send("A second one")  # one message waits at a time
        assert backend.sessions == []

        release.set()
        qtbot.waitUntil(lambda: any(isinstance(e, Finished) for e in events), timeout=5000)
        qtbot.waitUntil(lambda: not worker.busy and not window.replying, timeout=5000)
    finally:
        worker.shutdown()
    assert backend.session.calls == [(Message("user", "Are you there?"),)]
    assert window.conversation()[-1] == Message("assistant", "".join(REPLY))
    assert window.send_action.isEnabled()


def test_stop_withdraws_the_waiting_message_and_a_failed_load_says_so(qtbot, qsettings):
    backend, release = FakeBackend(), threading.Event()
    window, worker = slow_window(qtbot, qsettings, backend, release, spec="broken")
    try:
        assert window.send("First")
        window.stop_action.trigger()
        assert "waits unanswered" in window.statusBar().currentMessage()
        assert window.send("Second")  # sending is possible again, and waits again
        release.set()
        qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    finally:
        worker.shutdown()
    assert "not answered" in window.chat.toPlainText()
    assert backend.sessions == [] and window.info is None
    assert [m.content for m in window.conversation()] == ["First", "Second"]
