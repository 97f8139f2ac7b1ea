"""Each phase's place on the roofline, exactly as the engine's events report it.

The engine counts each forward pass's FLOPs and bytes and times it (`roofline` on PrefillDone
and Token); the machine's peaks come from a measured probe. Nothing here recomputes either:
the chart plots and quotes the events' own numbers.

A placed model's decode step also reads weights in (Token.transfer): against those bytes the
step has an intensity of its own, FLOPs per byte read in, which sits under a lower roof, the
read bandwidth the placement measured at load.
"""

from __future__ import annotations

import numpy as np

from engine.events import Roofline, Transfer
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
        # decode against the weights read in (placed models): FLOP per byte read, FLOP/s
        self.read_intensity = GrowableArray(np.float64)
        self.read_flops_per_s = GrowableArray(np.float64)
        self.latest_read: tuple[Roofline, Transfer] | None = None

    def add_prefill(self, turn: str, roofline: Roofline) -> None:
        self.prefills.append((turn, roofline))

    def add_decode(self, roofline: Roofline, transfer: Transfer | None = None) -> None:
        self.decode_intensity.append(roofline.intensity)
        self.decode_flops_per_s.append(roofline.flops_per_s)
        self.latest_decode = roofline
        if transfer is not None and transfer.bytes > 0:
            self.read_intensity.append(roofline.flops / transfer.bytes)
            self.read_flops_per_s.append(roofline.flops_per_s)
            self.latest_read = (roofline, transfer)

    @property
    def latest_prefill(self) -> Roofline | None:
        return self.prefills[-1][1] if self.prefills else None

    @property
    def empty(self) -> bool:
        return not self.prefills and not len(self.decode_intensity)
