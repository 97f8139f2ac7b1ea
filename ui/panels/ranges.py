"""Axis ranges that change when the data outgrows them, not every frame.

Auto-range re-measures every item and re-lays the axes out on each frame a curve grows. A range
with headroom is set once and kept while the data fits it, so most frames repaint the data only.
"""

from __future__ import annotations

GROW = 1.25  # a new range leaves this much room for the data to grow into


def headroom(limit: float, needed: float) -> float:
    """The upper end of an axis that must show 0..`needed`, given the one it has now.

    Kept while the data fits and still fills more than 1 / GROW**2 of it (a new reply that
    starts small gets a range of its own); otherwise `needed` plus room to grow.
    """
    if needed <= 0:
        return limit if limit > 0 else 1.0
    if needed <= limit <= needed * GROW * GROW:
        return limit
    return needed * GROW


class AxisLimit:
    """The upper end last set on one axis; `update` says whether it must change."""

    def __init__(self) -> None:
        self.limit = 0.0

    def update(self, needed: float) -> bool:
        limit = headroom(self.limit, needed)
        changed = limit != self.limit
        self.limit = limit
        return changed
