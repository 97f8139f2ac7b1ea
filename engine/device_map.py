"""The placement a load asks for, as the user writes it: `--device-map` and `--max-memory`.

    --device-map auto            fit what is free on each device (with headroom), disk for the rest
    --device-map gpu-layers=N    the first N decoder layers on the GPU, the rest in RAM / on disk
    --device-map balanced|sequential   accelerate's own strategies over --max-memory
    --max-memory cpu=250MiB,cuda:0=6GiB   caps per device; what does not fit goes to disk

Parsed here without torch, so LoadRequest can check its fields where it is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

STRATEGIES = ("auto", "balanced", "sequential")
UNITS = {
    "": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
DEVICE = re.compile(r"^(cpu|cuda(:\d+)?|\d+|mps)$")


class PlacementError(ValueError):
    """A placement that cannot be read or cannot work; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class DeviceMap:
    """`strategy` is "" (the whole model on its device: no placement), one of STRATEGIES, or
    "gpu-layers" with `gpu_layers` set."""

    strategy: str = ""
    gpu_layers: int = 0


@dataclass(frozen=True, slots=True)
class Proposal:
    """A placement that would fit, for a model that does not fit where it was asked to run."""

    line: str  # for the user: how much is missing, and the placement that fits
    device_map: str  # as --device-map takes it; "" when no placement would fit either
    max_memory: str  # as --max-memory takes it; "" for no cap


def parse_device_map(text: str) -> DeviceMap:
    text = text.strip().lower()
    if text in ("", "none"):
        return DeviceMap()
    if text in STRATEGIES:
        return DeviceMap(text)
    if text.startswith("gpu-layers="):
        count = text.removeprefix("gpu-layers=")
        if count.isdigit():
            return DeviceMap("gpu-layers", int(count))
    raise PlacementError(
        f"device map must be auto, balanced, sequential or gpu-layers=N, got {text!r}"
    )


def parse_size(text: str) -> int:
    """Bytes in "250MiB", "1.5GB", "4096" (bytes)."""
    match = SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS:
        raise PlacementError(f"not a size: {text!r} (write e.g. 250MiB, 2GiB or 1.5GB)")
    return int(float(match.group(1)) * UNITS[unit])


def parse_max_memory(text: str) -> dict[str, int]:
    """{"cpu": bytes, "cuda:0": bytes} from "cpu=250MiB,cuda:0=6GiB" ("cuda" means cuda:0)."""
    caps: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        device, equals, size = part.partition("=")
        device = device.strip().lower()
        if not equals or not DEVICE.match(device):
            raise PlacementError(
                f"max memory takes device=size pairs such as cpu=250MiB or cuda:0=6GiB,"
                f" got {part!r}"
            )
        if device.isdigit():
            device = f"cuda:{device}"
        caps["cuda:0" if device == "cuda" else device] = parse_size(size)
    return caps


def format_bytes(count: float) -> str:
    """1.2 GB, 610 MB, 12.3 MB: decimal units, as the panels say them."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= scale:
            value = count / scale
            return f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{count:.0f} B"
