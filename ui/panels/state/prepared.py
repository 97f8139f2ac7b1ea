"""Attention-row statistics worked out as events arrive, before the GUI thread ingests them.

The window's events come from the engine process through a receiving thread. That thread
calls `PreparedStats.prepare` on each batch: the per-row statistics of every attention block
(a prompt's 512 rows x 1,000 keys x 9 heads of four layers is much numpy work) are computed
there, while the GUI thread paints, and `InternalsState` only sums them when it ingests the
event. Numpy's reductions release the interpreter lock, so the two threads overlap.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from engine.events import Event, PrefillDone, Token
from ui.panels.state.attention import CHUNK_ROWS, RowStats, row_stats

# Events prepared and not ingested yet (a window that stopped ingesting, a reply cut short)
# are forgotten past this many: their statistics are then worked out on ingest as before.
MAX_WAITING = 4096


class PreparedStats:
    """RowStats per watched layer of each event with attention, keyed by the event itself.

    `prepare` may run in any thread; `take` runs where the event is ingested. An entry holds
    its event, so the event's id cannot be reused while the entry waits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: OrderedDict[int, tuple[Event, dict[int, RowStats]]] = OrderedDict()

    def prepare(self, events: Iterable[Event]) -> None:
        scratch = [np.empty(0, dtype=np.float32)]  # this call's own: callers may overlap
        for event in events:
            stats = _stats_of(event, scratch)
            if stats:
                with self._lock:
                    self._waiting[id(event)] = (event, stats)
                    while len(self._waiting) > MAX_WAITING:
                        self._waiting.popitem(last=False)

    def take(self, event: Event) -> dict[int, RowStats] | None:
        """The statistics prepared for `event` (once), or None if there are none."""
        with self._lock:
            entry = self._waiting.pop(id(event), None)
        return entry[1] if entry is not None and entry[0] is event else None

    def __len__(self) -> int:
        return len(self._waiting)


def _stats_of(event: Event, scratch: list[np.ndarray]) -> dict[int, RowStats]:
    """RowStats per layer of an event's attention (none for other events). `scratch[0]` is a
    buffer for the logarithms, grown as needed."""
    if isinstance(event, PrefillDone | Token) and event.head_stats:
        return {}  # the engine worked them out (events.HeadStatistics)
    if isinstance(event, PrefillDone):
        blocks = event.attention  # [heads, queries, keys]: the queries are the last keys
    elif isinstance(event, Token):
        rows = event.attention
        if len(rows) > 1 and len({row.shape for row in rows.values()}) == 1:
            return _token_stats(rows, scratch)
        blocks = {layer: row[:, None, :] for layer, row in rows.items()}
    else:
        return {}
    out: dict[int, RowStats] = {}
    for layer, block in blocks.items():
        heads, queries, keys = block.shape
        if queries == 0:
            continue
        size = heads * min(queries, CHUNK_ROWS) * keys
        if scratch[0].size < size:
            scratch[0] = np.empty(size, dtype=np.float32)
        out[layer] = row_stats(block, np.arange(keys - queries, keys), scratch[0])
    return out


def _token_stats(rows: dict[int, np.ndarray], scratch: list[np.ndarray]) -> dict[int, RowStats]:
    """A token's rows of every watched layer (each [heads, keys], one shape) in one pass, as
    one block of layers x heads rows: a row per layer cost the same ~15 numpy calls each, and
    the thread that receives the engine's events did that for every token."""
    layers = list(rows)
    stacked = np.stack([rows[layer] for layer in layers])  # [layers, heads, keys]
    count, heads, keys = stacked.shape
    if scratch[0].size < stacked.size:
        scratch[0] = np.empty(stacked.size, dtype=np.float32)
    stats = row_stats(stacked.reshape(count * heads, 1, keys), np.array([keys - 1]), scratch[0])
    return {
        layer: RowStats(
            stats.max_weight[index * heads : (index + 1) * heads],
            stats.entropy[index * heads : (index + 1) * heads],
        )
        for index, layer in enumerate(layers)
    }
