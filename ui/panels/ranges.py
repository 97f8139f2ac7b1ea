"""Plots that grow every token: ranges that change when the data outgrows them, and curves
that draw about two points per pixel.

Auto-range re-measures every item and re-lays the axes out on each frame a curve grows. A range
with headroom is set once and kept while the data fits it, so most frames repaint the data only.
"""

from __future__ import annotations

import numpy as np

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


def decimate(
    x: np.ndarray, y: np.ndarray, pixels: float, peak: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """`x`, `y` reduced to about two points per pixel, the last point always kept.

    Peak: each bin of points becomes its maximum and minimum (a lone slow step still shows);
    otherwise every k-th point. A 10,000-point curve drew every point each frame before: wide
    pens made that the most expensive paint of the window.
    """
    count = len(x)
    step = count // max(int(pixels), 1)
    if step < 2:
        return x, y
    whole = count // step * step
    starts = x[:whole:step]
    if peak:
        bins = y[:whole].reshape(-1, step)
        xs = np.repeat(starts, 2)
        ys = np.empty(xs.size, dtype=np.float64)
        ys[0::2] = bins.max(axis=1)
        ys[1::2] = bins.min(axis=1)
    else:
        xs, ys = starts, y[:whole:step]
    tail = slice(whole, count) if whole < count else slice(count - 1, count)
    return np.concatenate([xs, x[tail]]), np.concatenate([ys, y[tail]])
