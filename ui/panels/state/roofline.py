"""Each phase's place on the roofline, exactly as the engine's events report it.

The engine counts each forward pass's FLOPs and bytes and times it (`roofline` on PrefillDone
and Token); the machine's peaks come from a measured probe. Nothing here recomputes either:
the chart plots and quotes the events' own numbers.
"""

from __future__ import annotations

import numpy as np

from engine.events import Roofline
from ui.panels.state.arrays import GrowableArray


class RooflineTrace:
    """The prefill of every reply and the decode steps of the latest one."""

    def __init__(self) -> None:
        self.prefills: list[tuple[str, Roofline]] = []  # (turn, its prefill)
        self.start_reply()

    def start_reply(self) -> None:
        # Fresh arrays: the chart may still hold views of the previous reply's.
        self.decode_intensity = GrowableArray(np.float64)
        self.decode_flops_per_s = GrowableArray(np.float64)
        self.latest_decode: Roofline | None = None

    def add_prefill(self, turn: str, roofline: Roofline) -> None:
        self.prefills.append((turn, roofline))

    def add_decode(self, roofline: Roofline) -> None:
        self.decode_intensity.append(roofline.intensity)
        self.decode_flops_per_s.append(roofline.flops_per_s)
        self.latest_decode = roofline

    @property
    def latest_prefill(self) -> Roofline | None:
        return self.prefills[-1][1] if self.prefills else None

    @property
    def empty(self) -> bool:
        return not self.prefills and not len(self.decode_intensity)
