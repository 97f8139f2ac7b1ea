"""The synthetic engine's attention rows, kept as a GPU engine keeps its own.

A model's engine on a GPU works out a step's attention rows and their per-head statistics on
its device; its host thread puts the step's rows (device tensors) in the ring and sends the
statistics, and a row crosses to the host only when the window pulls it. To drive the window at
a GPU's token rate from two CPU cores, the synthetic engine does that same host work and no
more: a step's rows are `DeviceRows`, made when pulled (in the engine server's thread, where a
real engine pays its device-to-host copy), and the statistics come from running sums over each
layer's noise, a few numbers a head, every watched layer at once (`ReplyNoise.step`).

A watched layer's row at `keys` keys, before it is normalised: the layer's noise (uniform ** 4)
over its first `keys` keys, a sink on the first key (+SINK x keys) and weight on the last
RECENT_KEYS (+RECENT x keys each).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.events import HeadStatistics, frozen_array

SINK = 0.2
RECENT = 0.05
RECENT_KEYS = 4
SHORT = 16  # rows shorter than this are worked out whole (the sink and recent keys overlap)
TINY = float(np.finfo(np.float32).tiny)


def unnormalised(noise: np.ndarray, keys: int) -> np.ndarray:
    """[heads, keys] float32: a row's weights before normalising (see the module docstring)."""
    weights = noise[:, :keys].copy()
    weights[:, 0] += SINK * keys
    weights[:, -RECENT_KEYS:] += RECENT * keys
    return weights


def statistics(rows: np.ndarray) -> np.ndarray:
    """[2, heads, n] HeadStatistics of [heads, n, keys] causal rows (the last n positions),
    in numpy: the synthetic engine has no torch (engine/generate/head_stats.py is the model's)."""
    keys = rows.shape[2]
    positions = np.arange(keys - rows.shape[1], keys)
    largest = rows.max(axis=2)
    entropy = -(rows * np.log(np.maximum(rows, TINY))).sum(axis=2)
    return frozen_array(np.stack([largest, entropy / np.log(np.maximum(positions + 1, 2))]))


class DeviceRows:
    """One step's [heads, keys] rows of one layer, held as a GPU engine holds its own: not on
    the host. `np.asarray` makes them; `nbytes` is what they hold, for the ring's byte cap."""

    def __init__(self, noise: np.ndarray, keys: int, total: np.ndarray) -> None:
        self.noise = noise  # the layer's noise (kept: a longer reply's replaces it in the session)
        self.keys = keys
        self.total = total  # [heads] float64: each row's sum before normalising

    @property
    def nbytes(self) -> int:
        return int(self.noise.shape[0]) * self.keys * 4

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        rows = unnormalised(self.noise, self.keys) / self.total[:, None].astype(np.float32)
        return rows if dtype is None else rows.astype(dtype)


class ReplyNoise:
    """The watched layers' noise for one reply, with running sums over its keys: a step's row
    totals and statistics for every watched layer in a few array operations."""

    def __init__(self, noise: dict[int, np.ndarray], layers: tuple[int, ...], keys: int) -> None:
        """`noise`: each watched layer's [heads, >= keys] noise; `keys`: the reply's longest
        step's."""
        self.layers = layers
        self.noise = noise
        self.keys = keys
        wide = np.stack([noise[layer][:, :keys] for layer in layers]).astype(np.float64)
        self.wide = wide  # [layers, heads, keys]
        self.sums = np.cumsum(wide, axis=2)
        self.w_log_w = np.cumsum(wide * np.log(np.maximum(wide, TINY)), axis=2)
        self.maxima = np.maximum.accumulate(wide, axis=2)

    def step(self, keys: int) -> tuple[dict[int, DeviceRows], HeadStatistics]:
        """The rows of a step that attends over `keys` keys and their [2, heads]
        HeadStatistics, for every watched layer."""
        if keys < SHORT:
            return self._short(keys)
        wide, middle = self.wide, keys - RECENT_KEYS - 1  # the middle keys: 1 .. keys - 5
        edges = np.concatenate(
            [wide[:, :, :1] + SINK * keys, wide[:, :, keys - RECENT_KEYS : keys] + RECENT * keys],
            axis=2,
        )  # [layers, heads, 5]: the first key and the last four
        total = self.sums[:, :, middle] - self.sums[:, :, 0] + edges.sum(axis=2)
        w_log_w = self.w_log_w[:, :, middle] - self.w_log_w[:, :, 0]
        w_log_w += (edges * np.log(edges)).sum(axis=2)
        largest = np.maximum(self.maxima[:, :, middle], edges.max(axis=2))
        entropy = (np.log(total) - w_log_w / total) / np.log(keys)
        stats = np.stack([largest / total, entropy], axis=1)  # [layers, 2, heads]
        rows, statistics_ = {}, {}
        for i, layer in enumerate(self.layers):
            rows[layer] = DeviceRows(self.noise[layer], keys, total[i])
            statistics_[layer] = frozen_array(stats[i])
        return rows, statistics_

    def _short(self, keys: int) -> tuple[dict[int, DeviceRows], HeadStatistics]:
        rows, statistics_ = {}, {}
        for layer in self.layers:
            weights = unnormalised(self.noise[layer], keys)
            total = weights.sum(axis=1, dtype=np.float64)
            rows[layer] = DeviceRows(self.noise[layer], keys, total)
            normalised = weights / total[:, None].astype(np.float32)
            statistics_[layer] = frozen_array(statistics(normalised[:, None, :])[:, :, 0])
        return rows, statistics_
