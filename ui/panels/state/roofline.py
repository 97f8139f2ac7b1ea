"""Each phase's place on the roofline, exactly as the engine's events report it.

The engine counts each forward pass's FLOPs and bytes and times it (`roofline` on PrefillDone
and Token); the machine's peaks come from a measured probe. Nothing here recomputes either:
the chart plots and quotes the events' own numbers.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ui.panels.state.arrays import GrowableArray


class PhaseRoofline(Protocol):
    """What an event's `roofline` carries (engine.events)."""

    flops: float
    bytes: float
    intensity: float  # FLOPs per byte moved
    flops_per_s: float
    bytes_per_s: float
    bound: str  # "compute" or "memory"


class Peaks(Protocol):
    """The machine's measured peaks (engine.peaks)."""

    peak_flops_per_s: float
    peak_bytes_per_s: float
    dtype: str
    method: str


def roofline_of(event: object) -> PhaseRoofline | None:
    """The event's roofline, None for an event (or an engine) that carries none."""
    return getattr(event, "roofline", None)


class RooflineTrace:
    """The prefill of every reply and the decode steps of the latest one."""

    def __init__(self) -> None:
        self.prefills: list[tuple[str, PhaseRoofline]] = []  # (turn, its prefill)
        self.start_reply()

    def start_reply(self) -> None:
        # Fresh arrays: the chart may still hold views of the previous reply's.
        self.decode_intensity = GrowableArray(np.float64)
        self.decode_flops_per_s = GrowableArray(np.float64)
        self.latest_decode: PhaseRoofline | None = None

    def add_prefill(self, turn: str, roofline: PhaseRoofline) -> None:
        self.prefills.append((turn, roofline))

    def add_decode(self, roofline: PhaseRoofline) -> None:
        self.decode_intensity.append(roofline.intensity)
        self.decode_flops_per_s.append(roofline.flops_per_s)
        self.latest_decode = roofline

    @property
    def latest_prefill(self) -> PhaseRoofline | None:
        return self.prefills[-1][1] if self.prefills else None

    @property
    def empty(self) -> bool:
        return not self.prefills and not len(self.decode_intensity)
