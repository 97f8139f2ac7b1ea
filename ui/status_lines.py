"""The window's one-line texts about the model and the context (status bar, chat notes)."""

from __future__ import annotations

from engine.device_map import format_bytes
from engine.events import ModelInfo


def human_count(n: int) -> str:
    """135_000_000 -> "135M", 1_235_814_400 -> "1.2B", 950 -> "950"."""
    for unit, size in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= size:
            value = n / size
            text = f"{value:.1f}" if value < 10 else f"{value:.0f}"
            return text.removesuffix(".0") + unit
    return str(n)


def model_line(info: ModelInfo) -> str:
    params = human_count(info.parameters)
    line = f"{info.name} · {info.device} · {info.precision} {info.dtype} · {params} params"
    placement = info.placement
    if placement is not None and placement.moved_bytes:  # a model partly away from its device
        places = ", ".join(f"{format_bytes(b)} {p}" for p, b in placement.place_bytes)
        line += f" · placed: {places}"
    return line


def dropped_line(dropped: int, limit: int) -> str:
    return (
        f"The conversation outgrew the context window ({limit:,} tokens): the"
        f" {dropped} oldest messages were left out of this request."
    )
