"""Rows the window pulled from the engine for a chosen step, and the statistics that came with
its tokens instead of rows (events.HeadStatistics)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from engine.events import StepRows
from ui.panels.state.attention import RowStats

MAX_PULLED = 64  # steps whose fetched rows are kept (a user clicking around a reply)


def head_row_stats(statistics: np.ndarray) -> RowStats:
    """RowStats of an event's HeadStatistics: [2, heads] (a token's row) or [2, heads, n]."""
    values = np.asarray(statistics, dtype=np.float64)
    if values.ndim == 2:
        values = values[:, :, None]
    return RowStats(values[0], values[1])


class PulledRows:
    """Steps' rows fetched on request (by their query's context position), the positions
    whose step had left the engine's ring, and those asked for and not answered yet."""

    def __init__(self) -> None:
        self._rows: OrderedDict[int, dict[int, np.ndarray]] = OrderedDict()
        self.aged_out: set[int] = set()
        self.asked: set[int] = set()

    def clear(self) -> None:
        self._rows.clear()
        self.aged_out.clear()
        self.asked.clear()

    def add(self, event: StepRows, query: int) -> None:
        """The engine's answer for the step whose query sits at `query`."""
        self.asked.discard(query)
        if event.aged_out:
            self.aged_out.add(query)
            return
        self._rows[query] = dict(event.attention)
        self._rows.move_to_end(query)
        while len(self._rows) > MAX_PULLED:
            self._rows.popitem(last=False)

    def row_at(self, layer: int, query: int) -> np.ndarray | None:
        return self._rows.get(query, {}).get(layer)
