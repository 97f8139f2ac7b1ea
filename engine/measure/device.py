"""Pick where and in what precision the model runs, and time work on that device honestly."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(requested: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then the CPU; or what the user asked for, if it exists."""
    if requested == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(requested)
    except RuntimeError:
        device = torch.device("meta")  # refused below with the choices
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"unknown device {requested!r}: choose auto, cpu, cuda, cuda:N or mps")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("CUDA was requested but no CUDA device is available")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"{requested} was requested but this machine has {count} CUDA devices")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("MPS was requested but Apple's Metal backend is not available")
    return device


def pick_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """bf16 on a CUDA card that supports it, fp16 on MPS, fp32 on the CPU."""
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"unknown dtype {requested!r}: choose one of {', '.join(DTYPES)}")
        return DTYPES[requested]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "mps":
        return torch.float16
    return torch.float32


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels, so host clocks measure the device's work, not its launches."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


class Stopwatch:
    """Seconds between `start()` and `stop()`, with the device synchronised at both ends."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = 0.0

    def start(self) -> None:
        synchronize(self.device)
        self._start = time.perf_counter()

    def stop(self) -> float:
        synchronize(self.device)
        return time.perf_counter() - self._start


class EventStopwatch:
    """Stopwatch's interface on CUDA, timed by events on the stream: `start()` waits for
    nothing and `stop()` waits only for its own event, so a timed decode step adds no host sync
    of its own before the one that reads the token id (after which the event is done)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._stop = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]

    def start(self) -> None:
        self._start.record()

    def stop(self) -> float:
        self._stop.record()
        self._stop.synchronize()
        return float(self._start.elapsed_time(self._stop)) / 1000


class HostStopwatch(Stopwatch):
    """The host clock alone, nothing synchronised: for decode steps whose device work overlaps
    the host's (a step launched ahead), where waiting for the device would undo the overlap.
    Each step still ends with the host reading its token, so its time includes its work."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))


def stopwatch(device: torch.device) -> Stopwatch | EventStopwatch:
    """CUDA events on CUDA; elsewhere the host clock with the device synchronised."""
    return EventStopwatch(device) if device.type == "cuda" else Stopwatch(device)


def marker(device: torch.device) -> Callable[[], None]:
    """A point in the device's queue, now: the function returned waits until the device has
    done the work queued before it (and none queued after). The CPU has nothing queued."""
    if device.type != "cuda":
        return lambda: None
    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
    done.record()
    return done.synchronize
