"""SIGTERM (a logout, `kill`) and SIGINT (Ctrl+C in the terminal that started the window) close
the window as its close button does: the reply in progress is cut, kept and marked incomplete,
the engine quits and its shared-memory folder goes. Without this, SIGTERM ended the process at
once (Python's default) and Ctrl+C waited for the next Python slot to raise KeyboardInterrupt
in the middle of it.

Qt's event loop runs in C++, and Python runs a signal's handler only when Python code runs.
Python's C-level handler writes to the fd given to `signal.set_wakeup_fd`; a QSocketNotifier on
the other end of that socket pair wakes the loop, and the handler runs as its slot is entered.
"""

from __future__ import annotations

import contextlib
import signal
import socket

from PySide6.QtCore import QObject, QSocketNotifier, QTimer
from PySide6.QtWidgets import QWidget

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class CloseOnSignals(QObject):
    """Closes `window` on SIGTERM or SIGINT (made in the main thread); a child of the window,
    so it, its sockets and the handlers live as long as the window does."""

    def __init__(self, window: QWidget) -> None:
        super().__init__(window)
        self._window = window
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        signal.set_wakeup_fd(self._writer.fileno())
        self._notifier = QSocketNotifier(self._reader.fileno(), QSocketNotifier.Type.Read, self)
        self._notifier.activated.connect(self._drain)
        for number in SIGNALS:
            signal.signal(number, self._close)

    def _close(self, _number: int, _frame: object) -> None:
        QTimer.singleShot(0, self._window.close)  # from the loop, not inside whatever ran

    def _drain(self) -> None:
        with contextlib.suppress(OSError):  # nothing left to read
            while self._reader.recv(64):
                pass
