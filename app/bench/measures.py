"""What the window benchmarks measure of a reply and of the processes: a reply as the GUI
thread saw it, CPU seconds and memory read from /proc, event-loop stalls, and medians with
their bootstrap intervals."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from app.server.os_threads import switches_per_s
from engine.events import Event, Finished, Token


@dataclass
class WindowReply:
    """One reply in the window, as the GUI thread saw it."""

    sent: float
    finished: Finished | None = None
    first_token: float | None = None
    first_cpu: float = 0.0
    first_process_cpu: float = 0.0  # the window process's CPU, all its threads
    end: float | None = None
    end_cpu: float = 0.0
    end_process_cpu: float = 0.0
    beats: list[float] = field(default_factory=list)
    beat_cpu: list[float] = field(default_factory=list)  # the GUI thread's CPU time at each

    def beat(self) -> None:
        self.beats.append(time.perf_counter())
        self.beat_cpu.append(time.thread_time())

    engine_cpu_s: float | None = None  # the engine process's CPU over the whole reply
    # the engine's threads preempted per second over the whole reply, all of them together
    engine_preempted_per_s: float | None = None
    frames: Any = None  # () -> the internals view's frames drawn so far
    first_frames: int = 0
    end_frames: int = 0
    # () -> {"window": Switches, "engine": Switches}: read outside the CPU times above
    switches: Any = None
    first_switches: Any = None
    end_switches: Any = None

    def on_event(self, event: Event) -> None:
        if isinstance(event, Token) and self.first_token is None:
            self.first_switches = self.switches() if self.switches else None
            self.first_token, self.first_cpu = time.perf_counter(), time.thread_time()
            self.first_process_cpu = time.process_time()
            self.first_frames = self.frames() if self.frames else 0
        elif isinstance(event, Finished):
            self.end, self.end_cpu = time.perf_counter(), time.thread_time()
            self.end_process_cpu = time.process_time()
            self.end_frames = self.frames() if self.frames else 0
            self.end_switches = self.switches() if self.switches else None
            self.finished = event

    @property
    def switches_per_s(self) -> dict[str, dict[str, list[float]]]:
        """Per process ("window", "engine") and thread name, [wake-ups, preemptions] per wall
        second between the first token and the Finished (app.server.os_threads)."""
        wall = (self.end or 0.0) - (self.first_token or 0.0)
        if not self.first_switches or not self.end_switches:
            return {}
        return {
            side: switches_per_s(self.first_switches[side], self.end_switches[side], wall)
            for side in self.end_switches
        }

    @property
    def frames_per_s(self) -> float:
        """Frames of the internals panels per wall second, first token to Finished."""
        wall = (self.end or 0.0) - (self.first_token or 0.0)
        return (self.end_frames - self.first_frames) / wall if wall > 0 else 0.0

    @property
    def gui_cpu_per_s(self) -> float:
        """GUI-thread CPU seconds per wall second between the first token and the Finished."""
        wall = (self.end or 0.0) - (self.first_token or 0.0)
        return (self.end_cpu - self.first_cpu) / wall if wall > 0 else 0.0

    @property
    def window_cpu_per_s(self) -> float:
        """The whole window process's CPU seconds (the GUI thread, the thread that reads the
        engine's pipe, Qt's own) per wall second, first token to Finished."""
        wall = (self.end or 0.0) - (self.first_token or 0.0)
        return (self.end_process_cpu - self.first_process_cpu) / wall if wall > 0 else 0.0


def process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), or None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_of(pid: int | None) -> float | None:
    """User + system CPU seconds a process has used, all its threads (Linux /proc), or None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_of(pid: int | None) -> int | None:
    """Peak resident memory of another process in MiB (Linux /proc), or None."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024)
    except OSError:
        pass
    return None


def stall_statistics(beats: Sequence[float], interval_s: float) -> tuple[float, float]:
    """Longest and 99th-percentile stall in seconds: gaps between beats beyond the interval."""
    if len(beats) < 2:
        return 0.0, 0.0
    stalls = stalls_of(beats, interval_s)
    return float(stalls.max()), float(np.percentile(stalls, 99))


def stalls_of(beats: Sequence[float], interval_s: float) -> np.ndarray:
    """Each gap between heartbeats beyond the interval, in seconds (0 where on time)."""
    return np.maximum(np.diff(np.asarray(beats)) - interval_s, 0.0)


def own_stalls(reply: WindowReply, interval_s: float) -> np.ndarray:
    """Per gap between heartbeats, the stall (beyond the interval) the GUI thread spent on a
    core, in seconds: at most its CPU time in the gap."""
    stalls = stalls_of(reply.beats, interval_s)
    if not stalls.size:
        return stalls
    own: np.ndarray = np.minimum(stalls, np.diff(np.asarray(reply.beat_cpu)))
    return own


def spread(values_ms: np.ndarray) -> dict[str, float]:
    if not values_ms.size:
        return {"p50": 0.0, "p99": 0.0, "max": 0.0}
    return {
        "p50": round(float(np.percentile(values_ms, 50)), 1),
        "p99": round(float(np.percentile(values_ms, 99)), 1),
        "max": round(float(values_ms.max()), 1),
    }


def less(after: float | None, before: float | None) -> float | None:
    return after - before if after is not None and before is not None else None


def wall_decode(finished: Finished) -> float:
    """Tokens after the first per wall second after it (total_s counts every second)."""
    steps, seconds = finished.generated_tokens - 1, finished.total_s - finished.ttft_s
    return steps / seconds if steps > 0 and seconds > 0 else 0.0


def median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def paired(window: list[float], headless: list[float]) -> float | None:
    ratios = [w / h for w, h in zip(window, headless, strict=False) if h]
    return round(statistics.median(ratios), 3) if ratios else None


def paired_interval(
    window: list[float], headless: list[float], draws: int = 2000
) -> list[float] | None:
    """A 90% bootstrap interval of the paired median ratio (resampling the pairs)."""
    ratios = np.asarray([w / h for w, h in zip(window, headless, strict=False) if h])
    if ratios.size < 2:
        return None
    picks = np.random.default_rng(0).integers(0, ratios.size, (draws, ratios.size))
    medians = np.median(ratios[picks], axis=1)
    return [round(float(q), 3) for q in np.percentile(medians, [5, 95])]


def median_switches(rates: Sequence[dict[str, dict[str, list[float]]]]) -> dict[str, Any]:
    """Replies' WindowReply.switches_per_s, as the median per process and thread name of
    {"wakeups": …, "preempted": …} a second (a name counts the replies it ran in)."""
    gathered: dict[str, dict[str, list[list[float]]]] = {}
    for reply in rates:
        for side, threads in reply.items():
            for name, pair in threads.items():
                gathered.setdefault(side, {}).setdefault(name, []).append(pair)
    return {
        side: {
            name: {
                "wakeups": round(median([pair[0] for pair in pairs]), 1),
                "preempted": round(median([pair[1] for pair in pairs]), 1),
            }
            for name, pairs in sorted(threads.items())
        }
        for side, threads in gathered.items()
    }
