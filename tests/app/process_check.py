"""An autouse fixture for the app and window tests: no engine process outlives its test."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def no_engine_process_left() -> Iterator[None]:
    """Fail the test if a child process it started is still running when it ends."""
    yield
    left = multiprocessing.active_children()  # also reaps the ones that have ended
    for child in left:  # end them so one leak does not fail every later test
        child.kill()
        child.join(5)
    if left:
        pytest.fail(f"test left {len(left)} process(es) running: {left}", pytrace=False)
