"""Running the GUI's event loop until something happened: how the benchmarks wait."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from PySide6.QtCore import QEventLoop, Qt, QTimer

# How often a wait checks whether it is over. The waits run the event loop of the GUI thread
# being measured: a 1 ms poll woke it 1,000 times a second, ~0.05 of a core of its CPU that the
# window itself never spends.
POLL_MS = 10


def run_for(seconds: float) -> None:
    """Run the event loop for `seconds` (a precise timer: Qt's default, coarse, may fire 5%
    early, and a measurement over "one second" then spans 0.95)."""
    loop = QEventLoop()
    timer = QTimer()
    timer.setSingleShot(True)
    timer.setTimerType(Qt.TimerType.PreciseTimer)
    timer.timeout.connect(loop.quit)
    timer.start(round(seconds * 1000))
    loop.exec()


def run_until(done: Callable[[], bool], timeout_s: float) -> float:
    """Run the event loop until `done()`; returns the time it became true (to POLL_MS)."""
    deadline = time.perf_counter() + timeout_s
    loop = QEventLoop()
    poll = QTimer()
    poll.setInterval(POLL_MS)

    def check() -> None:
        if done() or time.perf_counter() > deadline:
            loop.quit()

    poll.timeout.connect(check)
    poll.start()
    if not done():
        loop.exec()
    poll.stop()
    if not done():
        raise TimeoutError(f"the window did not get there within {timeout_s:.0f} s")
    return time.perf_counter()


def wait_for_signal(signal: Any, done: Callable[[], object], timeout_s: float) -> None:
    """Run the event loop until `done()`, checking it when `signal` fires (no polling)."""
    loop = QEventLoop()

    def check(*_args: Any) -> None:
        if done():
            loop.quit()

    signal.connect(check)
    QTimer.singleShot(round(timeout_s * 1000), loop.quit)
    if not done():
        loop.exec()
    signal.disconnect(check)
    if not done():
        raise TimeoutError(f"the engine did not answer within {timeout_s:.0f} s")


def quiet_offscreen(_kind: Any, _context: Any, message: str) -> None:
    """Drop the offscreen platform's "This plugin does not support raise()" notes."""
    if not message.startswith("This plugin does not support"):
        print(message, file=sys.stderr)
