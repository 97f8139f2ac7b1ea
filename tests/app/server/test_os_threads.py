"""A thread named for the OS can be found, and its CPU time read, from another process's view."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from app.server.os_threads import name_this_thread, thread_cpu_s

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def test_a_named_threads_cpu_time_is_read_by_its_name():
    done = threading.Event()
    spun = threading.Event()

    def spin() -> None:
        name_this_thread("gb-test-spin")
        started = time.thread_time()
        while time.thread_time() - started < 0.2:
            pass
        spun.set()
        done.wait(5)

    thread = threading.Thread(target=spin)
    thread.start()
    try:
        assert spun.wait(10)
        cpu = thread_cpu_s(os.getpid(), "gb-test-spin")
        assert cpu is not None and 0.15 <= cpu < 5
        assert thread_cpu_s(os.getpid(), "no-such-thread") is None
    finally:
        done.set()
        thread.join()
