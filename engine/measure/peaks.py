"""The machine's ceilings, measured: peak FLOP/s and peak memory bandwidth for one device/dtype.

A roofline needs two numbers no spec sheet gives for this machine as it runs now: how fast
a large matmul goes in the model's compute dtype, and how fast a large copy moves memory.
Both are probed here in about a second (best of a few repeats, the device synchronised
around each) and kept per machine, device, dtype and thread count in the cache folder
(`peaks.json` beside the dequantised models), so later starts read them at once.
`glassbox peaks --refresh` measures again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engine.disk.cache_folder import default_cache_dir
from engine.events import Peaks
from engine.measure.device import synchronize
from engine.weights import ggml_kernel

CACHE_FILE = "peaks.json"
PROBE_VERSION = 3  # part of the cache key: peaks from an older probe are measured again


@dataclass(frozen=True, slots=True)
class ProbeSize:
    matmul: int  # square matmul side
    copy_bytes: int  # bytes of the source buffer of the copy
    seconds: float  # keep repeating each probe at least this long (best repeat counts)


# The copy must outgrow the last-level cache (105 MiB on some server CPUs) to measure memory.
FULL_CPU = ProbeSize(matmul=2048, copy_bytes=256 << 20, seconds=0.3)
FULL_GPU = ProbeSize(matmul=8192, copy_bytes=1 << 30, seconds=0.3)
QUICK = ProbeSize(matmul=256, copy_bytes=4 << 20, seconds=0.02)  # tests: plumbing, not truth

_memo: dict[str, Peaks] = {}
log = logging.getLogger(__name__)


def machine_peaks(
    device: torch.device | str,
    dtype: torch.dtype | str,
    refresh: bool = False,
    quick: bool = False,
    cache_dir: Path | None = None,
) -> Peaks:
    """The cached peaks of this machine for `device` and `dtype`, measured if there are none
    (or if `refresh`). A quick probe is never mistaken for a full one: it is kept apart."""
    device, dtype = torch.device(device), _dtype(dtype)
    key = machine_key(device, dtype) + ("|quick" if quick else "")
    if not refresh and key in _memo:
        return _memo[key]
    path = (cache_dir or default_cache_dir()) / CACHE_FILE
    stored = _read(path)
    recalled = None if refresh else _recall(key, stored)
    if recalled is not None:
        return recalled
    peaks = measure(device, dtype, QUICK if quick else None)
    stored[key] = asdict(peaks)
    _write(path, stored)
    _memo[key] = peaks
    return peaks


def peaks_or_none(device: torch.device | str, dtype: torch.dtype | str) -> Peaks | None:
    """machine_peaks, or None (logged) when the probe fails: that costs the roofline its
    bound, never a load or a chat."""
    try:
        return machine_peaks(device, dtype)
    except Exception:
        log.exception("measuring the machine's peaks failed")
        return None


def known(
    device: torch.device | str, dtype: torch.dtype | str, cache_dir: Path | None = None
) -> bool:
    """Whether machine_peaks would answer from memory or the cache, without measuring (what
    it finds in the cache is kept in memory, so that call reads nothing again)."""
    key = machine_key(torch.device(device), _dtype(dtype))
    stored = {} if key in _memo else _read((cache_dir or default_cache_dir()) / CACHE_FILE)
    return key in _memo or _recall(key, stored) is not None


def _recall(key: str, stored: dict[str, Any]) -> Peaks | None:
    """The stored peaks for `key`, now also in memory; None if absent or written by another
    version (then they are measured again)."""
    try:
        peaks = Peaks(**stored[key])
    except (KeyError, TypeError):
        return None
    _memo[key] = peaks
    return peaks


def measure(device: torch.device, dtype: torch.dtype, size: ProbeSize | None = None) -> Peaks:
    """Probe peak FLOP/s (a square matmul in `dtype`) and bytes/s (a copy, and a read of the
    same buffer as a matrix-vector product) on `device`.

    A copy's counted bytes (read + write) understate what reads alone reach: its writes also
    read each line first. A decode step mostly reads weights, so the faster of the two is the
    bandwidth ceiling.
    """
    size = size or (FULL_CPU if device.type == "cpu" else FULL_GPU)
    arithmetic = arithmetic_dtype(device, dtype)
    n = _matmul_side(size.matmul, device, arithmetic)
    matmul_s = _matmul_seconds(n, device, arithmetic, size.seconds)
    copy_rate, read_rate = _bandwidths(size.copy_bytes, device, size.seconds)
    name = _dtype_name(dtype)
    method = (
        f"best of repeated {n}x{n} {_dtype_name(arithmetic)} matmuls (2·n³ FLOP); memory:"
        " the faster of a"
        f" {size.copy_bytes >> 20} MiB copy (read + write: {copy_rate / 1e9:.3g} GB/s) and a"
        f" matrix-vector read of it ({read_rate / 1e9:.3g} GB/s); on {_device_name(device)},"
        f" {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    return Peaks(
        peak_flops_per_s=2 * n**3 / matmul_s,
        peak_bytes_per_s=max(copy_rate, read_rate),
        dtype=name,
        device=str(device),
        method=method,
    )


def arithmetic_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype whose matmul is the compute roof for a model in `dtype`: float32 for bf16 on a
    CPU without bf16 dot products, where torch widens bf16 to float32 before multiplying (its
    bf16 rate is a conversion's, not the machine's ceiling) and the fast model multiplies a
    prompt in float32 (ggml_kernel.dense_dtype); `dtype` itself elsewhere."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return ggml_kernel.dense_dtype()
    return dtype


def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """What the peaks depend on: the machine, the device, the dtype and the threads used."""
    return "|".join(
        (
            platform.node(),
            platform.machine(),
            _device_name(device),
            _dtype_name(dtype),
            f"threads={torch.get_num_threads()}",
            f"torch={torch.__version__}",
            f"probe={PROBE_VERSION}",
        )
    )


def _matmul_side(largest: int, device: torch.device, dtype: torch.dtype) -> int:
    """The matmul side to time: doubled from 256 while one product takes under 0.1 s, so a
    machine slow in `dtype` (bf16 without hardware support) still probes in about a second."""
    n = min(256, largest)
    while n < largest:
        a = torch.ones(n, n, device=device, dtype=dtype)
        synchronize(device)
        start = time.perf_counter()
        torch.mm(a, a)
        synchronize(device)
        if time.perf_counter() - start > 0.1:
            break
        n *= 2
    return n


def _matmul_seconds(n: int, device: torch.device, dtype: torch.dtype, at_least_s: float) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return _best(lambda: torch.mm(a, b, out=out), device, at_least_s)


def _bandwidths(nbytes: int, device: torch.device, at_least_s: float) -> tuple[float, float]:
    """Bytes/s of the fastest copy of `nbytes` (read + written) and of the fastest read of
    them as a float32 matrix times a vector (each weight read once, as in a decode step)."""
    source = torch.ones(nbytes // 4, device=device)
    target = torch.empty_like(source)
    copy_s = _best(lambda: target.copy_(source), device, at_least_s)
    matrix = source.view(-1, 1024)  # [rows, 1024]
    vector = torch.ones(1024, 1, device=device)
    out = torch.empty(matrix.shape[0], 1, device=device)
    read_s = _best(lambda: torch.mm(matrix, vector, out=out), device, at_least_s)
    return 2 * _nbytes(source) / copy_s, _nbytes(source) / read_s


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _best(work: Callable[[], object], device: torch.device, at_least_s: float) -> float:
    """The fastest of several timed runs after a warm-up (at least 3, at least `at_least_s`)."""
    work()
    synchronize(device)
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 3 or spent < at_least_s:
        start = time.perf_counter()
        work()
        synchronize(device)
        elapsed = time.perf_counter() - start
        best, spent, runs = min(best, elapsed), spent + elapsed, runs + 1
    return best


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "cpu":
        return f"CPU ({_cpu_model()}, {os.cpu_count()} cores)"
    return device.type


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, dtype.removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}")
    return value


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: measure again
        return {}
    return data if isinstance(data, dict) else {}


def _write(path: Path, data: dict[str, Any]) -> None:
    """Replace the file in one step, so a reader never sees half of it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps(data, indent=1))
        partial.replace(path)
    except OSError:  # a read-only cache folder costs a re-measure next time, nothing else
        pass
