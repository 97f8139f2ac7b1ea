"""Threads the operating system can tell apart: a name it shows (/proc/PID/task/TID/comm on
Linux, `top -H`), and the CPU time of a named thread of another process, so a benchmark can
say what the engine's sending thread costs."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

PR_SET_NAME = 15  # prctl(2)


def name_this_thread(name: str) -> None:
    """Give the calling thread `name` (at most 15 bytes) where the OS keeps one (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a name for tools only: nothing depends on it


def thread_cpu_s(pid: int, name: str) -> float | None:
    """User + system CPU seconds of the threads of process `pid` named `name` (None: not
    readable, or no such thread)."""
    tasks = Path(f"/proc/{pid}/task")
    ticks, found = 0, False
    try:
        for task in tasks.iterdir():
            if (task / "comm").read_text().strip() != name[:15]:
                continue
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
            found = True
    except OSError:
        return None
    return ticks / os.sysconf("SC_CLK_TCK") if found else None
