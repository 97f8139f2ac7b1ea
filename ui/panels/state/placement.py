"""Where the layers live and what each decode step spent moving weights, as the events say.

The placement comes with the model (ModelInfo.placement); each decode step's Token carries the
bytes its pass read in and the time spent reading them (Token.transfer). The step's compute is
its measured time less that transfer. Nothing here is estimated: the predictions beside each
step are the engine's own, from a probe pass at load (bytes moved per pass / its read
bandwidth, and that plus its compute for the whole step).
"""

from __future__ import annotations

import numpy as np

from engine.device_map import format_bytes
from engine.events import ModelInfo, Placement, Token
from ui.panels.state.arrays import GrowableArray

# Columns of a step: its time, the part spent bringing weights in, the predictions of that
# part and of the whole step, bytes read
STEP_S, TRANSFER_S, PREDICTED_S, PREDICTED_STEP_S, BYTES = range(5)


class PlacementTrace:
    """The model's placement and the latest reply's decode steps (time, transfer, bytes)."""

    def __init__(self) -> None:
        self.info: ModelInfo | None = None
        self.start_reply()

    @property
    def placement(self) -> Placement | None:
        return self.info.placement if self.info is not None else None

    def set_model(self, info: ModelInfo) -> None:
        self.info = info
        self.start_reply()

    def start_reply(self) -> None:
        # Fresh: the chart may still hold a view of the previous reply's buffer.
        self.steps = GrowableArray(np.float64, width=5)

    def add(self, token: Token) -> bool:
        """Take a decode step's transfer in; False for a token that moved nothing."""
        if token.transfer is None:
            return False
        transfer = token.transfer
        self.steps.append(
            (
                token.seconds,
                transfer.seconds,
                transfer.predicted_s,
                transfer.predicted_step_s,
                transfer.bytes,
            )
        )
        return True

    def sentence(self) -> str:
        """What bounds the latest step, in one sentence."""
        placement = self.placement
        if placement is None:
            return self._unplaced()
        if not placement.moved_bytes:
            return self._resident(placement)
        if placement.mapped:
            return self._mapped(placement)
        if not len(self.steps):
            return (
                f"Each step will read {format_bytes(placement.moved_bytes)} of weights in"
                f" (predicted {placement.predicted_transfer_s * 1000:.0f} ms at the"
                f" {format_bytes(placement.read_bytes_per_s)}/s measured at load, of a"
                f" {placement.predicted_step_s * 1000:.0f} ms step)."
            )
        step, transfer, predicted, predicted_step, moved = (float(v) for v in self.steps.last())  # type: ignore[union-attr]
        share = transfer / step if step > 0 else 0.0
        source = "disk" if placement.execution_device == "cpu" else "RAM and disk"
        bound = "moving weights bounds it" if share >= 0.5 else "compute bounds it"
        return (
            f"{share:.0%} of this step ({step * 1000:.0f} ms) moved {format_bytes(moved)}"
            f" from {source} ({transfer * 1000:.0f} ms, predicted {predicted * 1000:.0f} ms;"
            f" the step predicted {predicted_step * 1000:.0f} ms): {bound}."
        )

    def _mapped(self, placement: Placement) -> str:
        """Glassbox's own model: its disk is the mapped file, read only where the OS's page
        cache has dropped it."""
        held = format_bytes(placement.moved_bytes)
        if not len(self.steps):
            return (
                f"The layers placed on disk ({held}) compute from the mapped file: storage is"
                " read only for what the OS has not kept in its page cache (at the"
                f" {format_bytes(placement.read_bytes_per_s)}/s measured at load)."
            )
        step, transfer, predicted, predicted_step, moved = (float(v) for v in self.steps.last())  # type: ignore[union-attr]
        if not moved:
            return (
                f"This step ({step * 1000:.0f} ms) read nothing from disk: the OS kept all"
                f" {held} of the disk-placed layers in its page cache, so compute bounds it"
                f" (predicted {predicted_step * 1000:.0f} ms)."
            )
        share = transfer / step if step > 0 else 0.0
        bound = "reading the file bounds it" if share >= 0.5 else "compute bounds it"
        return (
            f"{share:.0%} of this step ({step * 1000:.0f} ms) read {format_bytes(moved)} of the"
            f" {held} placed on disk back from the file, which the OS had dropped from its page"
            f" cache ({transfer * 1000:.0f} ms, predicted {predicted * 1000:.0f} ms; the step"
            f" predicted {predicted_step * 1000:.0f} ms): {bound}."
        )

    @staticmethod
    def _resident(placement: Placement) -> str:
        places = [place for place, _ in placement.place_bytes]
        if len(places) < 2:
            return f"Every weight is on {placement.execution_device}: no step moves any."
        return (
            f"Every weight stays where it was placed ({', '.join(places)}): no step moves any;"
            " each token's hidden state goes from one device to the next, layer by layer."
        )

    def _unplaced(self) -> str:
        if self.info is None:
            return ""
        if self.info.precision == "fast":
            return (
                "The whole model is in memory (its 4-bit repacks mapped from the cache"
                " folder): nothing moves per token. Load it with a RAM cap (--max-memory, or"
                " Placement in Load model…) and the layers past the cap compute from the"
                " mapped file instead."
            )
        return (
            f"The whole model is on {self.info.device}: nothing moves per token. Load with a"
            " placement (a RAM cap, layers on the GPU) to run a model bigger than memory."
        )
