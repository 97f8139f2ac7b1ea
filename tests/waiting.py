"""Waiting in tests for what another thread or process makes true and signals nowhere."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.001


def wait_until(done: Callable[[], bool], seconds: float = 30.0) -> bool:
    """Poll `done` until it holds (True) or `seconds` have passed (False): a loaded machine
    makes the wait longer, never the answer different."""
    deadline = time.monotonic() + seconds
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True
