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


# thread name -> (voluntary, involuntary) context switches, summed over its threads
Switches = dict[str, tuple[int, int]]
MAIN_THREAD = "main"  # the name `context_switches` gives a process's first thread


def context_switches(pid: int) -> Switches:
    """How often each thread of process `pid` has stopped running so far, by thread name
    (Linux /proc; empty elsewhere): voluntarily (it waited, for a wake-up, a lock or the
    interpreter lock) or not (another thread was given its core). The first thread is
    MAIN_THREAD; the others go by the name the OS shows (torch's OpenMP workers inherit the
    process's)."""
    switches: Switches = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return switches
    for task in tasks:
        try:
            name = MAIN_THREAD if task.name == str(pid) else (task / "comm").read_text().strip()
            status = (task / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        counts = dict(line.split(":", 1) for line in status.splitlines() if "ctxt_switches" in line)
        voluntary = int(counts.get("voluntary_ctxt_switches", 0))
        involuntary = int(counts.get("nonvoluntary_ctxt_switches", 0))
        before = switches.get(name, (0, 0))
        switches[name] = (before[0] + voluntary, before[1] + involuntary)
    return switches


def switches_per_s(before: Switches, after: Switches, seconds: float) -> dict[str, list[float]]:
    """Each thread name's [wake-ups, preemptions] per second between two readings (a thread
    that ended in between counts nothing, whatever it did)."""
    if seconds <= 0:
        return {}
    rates = {}
    for name, (voluntary, involuntary) in after.items():
        was = before.get(name, (0, 0))
        rates[name] = [
            max(voluntary - was[0], 0) / seconds,
            max(involuntary - was[1], 0) / seconds,
        ]
    return rates
