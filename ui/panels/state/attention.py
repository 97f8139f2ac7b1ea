"""One layer's attention rows as they arrive, and running per-head statistics over them."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from engine.events import PooledBlock
from engine.settings import rows_within

# Weights kept per head of a watched layer: 256 rows up to 2,048 keys of context, fewer past
# that (rows_within). At 10,000 keys, 52 rows: 75 MB for four layers of nine heads, not 370.
ATTENTION_CELLS = 256 * 2048

# The attention mosaic pools rows in blocks of 1-8 (256 rows on at least 32 cells): dropping
# whole blocks lets it shift what it pooled instead of pooling every row again. Halving 256
# rows always did; a cell budget's limits (52 rows at 10,000 keys) do not, and the mosaic then
# pooled everything again at each drop, and the stress's stalls grew.
DROP_BLOCK = 8

_serials = itertools.count()


class AttentionRows:
    """One layer's attention as a [heads, rows, keys] matrix that grows row by row.

    Row r holds the weights of the query at context position `positions[r]` over keys
    0..keys-1; keys after a row's own position are zero (the causal mask). Each row is kept as
    the read-only [heads, keys] array its event carries, so appending copies nothing and a
    longer context never reallocates what is stored (a dense buffer had to copy every row each
    time the keys outgrew it: hundreds of milliseconds per event at 10,000 keys). Past
    `limit` rows (`max_rows`, fewer once rows x keys passes `max_cells`) the oldest half is
    dropped. `matrix` and `padded` build dense copies.

    A prompt pooled by the engine (`append_pooled`) holds its first rows as placeholders
    (None) until the rows themselves come (`fill_prompt`): the buffer's first
    `placeholders` rows, whose cells `pooled` holds; their weights read as NaN meanwhile.
    """

    def __init__(
        self,
        heads: int,
        max_rows: int = 256,
        capacity: int = 64,
        max_cells: int | None = ATTENTION_CELLS,
    ) -> None:
        # `capacity` is accepted for callers of the dense buffer this replaced; rows need none.
        self.serial = next(_serials)  # tells one reply's buffer from the next
        self.heads = heads
        self.max_rows = max_rows
        self.max_cells = max_cells
        # [heads, n] each, n = its query position + 1 or more; None: a placeholder (see above)
        self._rows: list[np.ndarray | None] = []
        self._positions: list[int] = []
        # Per row, (block, query) where it is a prompt block's row as append_block kept it:
        # a run of them is read from the block itself (prompt_run), not copied row by row.
        self._sources: list[tuple[np.ndarray, int] | None] = []
        self.keys = 0
        self.dropped = 0  # rows dropped from the top since the reply began
        self.pooled: PooledBlock | None = None  # the cells of the placeholder rows
        self._pooled_dropped = 0  # `dropped` when they came
        self.filled = 0  # times placeholders were filled with their rows
        self.prompt_gone = False  # the engine no longer holds the placeholders' rows

    @property
    def rows(self) -> int:
        return len(self._rows)

    @property
    def placeholders(self) -> int:
        """How many of the first rows are placeholders (the pooled prompt's, rows not here)."""
        if self.pooled is None:
            return 0
        return max(self.pooled.rows - self.pooled_offset, 0)

    @property
    def pooled_offset(self) -> int:
        """The pooled block's row that buffer row 0 is (its rows dropped since it came)."""
        return self.dropped - self._pooled_dropped

    def limit(self, keys: int) -> int:
        """The rows kept once the context holds `keys` keys."""
        return rows_within(self.max_rows, self.max_cells, keys)

    @property
    def positions(self) -> np.ndarray:
        return np.array(self._positions, dtype=np.int64)

    def matrix(self, first_row: int = 0) -> np.ndarray:
        """A dense copy [heads, rows - first_row, keys] of the filled part."""
        return self.padded(first_row, self.keys)

    def padded(
        self,
        first_row: int,
        keys: int,
        end_row: int | None = None,
        scratch: np.ndarray | None = None,
    ) -> np.ndarray:
        """Rows `first_row` to `end_row` as a dense [heads, n, keys] copy, zeros past each row;
        written into `scratch` (a float32 buffer the caller keeps) where it is large enough:
        a fresh block of a few MB each time cost the kernel a page fault every 4 KB."""
        rows = self._rows[first_row:end_row]
        shape = (self.heads, len(rows), keys)
        size = shape[0] * shape[1] * shape[2]
        if scratch is not None and scratch.size >= size:
            out = scratch[:size].reshape(shape)
            out.fill(0.0)
        else:
            out = np.zeros(shape, dtype=np.float32)
        for index, row in enumerate(rows):
            if row is None:  # a placeholder: zeros, its cells come from `pooled`
                continue
            width = min(row.shape[1], keys)
            out[:, index, :width] = row[:, :width]
        return out

    def prompt_run(self, first_row: int, end_row: int) -> tuple[np.ndarray, int, int] | None:
        """(block, first query, rows) where rows `first_row`.. (at most to `end_row`) are
        consecutive queries of one prompt block, as `append_block` kept them; else None.

        Their weights up to the first row's own position are the block's own (no row of the
        run ends before it), so a reader can take that part of the block without a copy."""
        source = self._sources[first_row] if first_row < len(self._sources) else None
        if source is None:
            return None
        block, query = source
        count = 1
        end_row = min(end_row, len(self._sources))
        while first_row + count < end_row:
            following = self._sources[first_row + count]
            if following is None or following[0] is not block or following[1] != query + count:
                break
            count += 1
        return block, query, count

    def append_block(self, block: np.ndarray) -> int:
        """Append a prefill matrix [heads, queries, keys]; the queries are the last positions.

        Returns how many leading rows rewrote a position already present (0 or 1); the rest
        are new.
        """
        _heads, queries, keys = block.shape
        first = keys - queries
        skip = 0
        if queries and self._positions and self._positions[-1] == first:
            self._append(block[:, 0, : first + 1], first)
            self._sources[-1] = (block, 0)
            skip = 1
        limit = self.limit(max(self.keys, keys))
        count = min(queries - skip, limit)
        if count <= 0:
            return skip
        self._drop(max(self.rows + count - limit, 0))
        for query in range(queries - count, queries):
            position = first + query
            self._rows.append(block[:, query, : position + 1])  # views: no copy
            self._positions.append(position)
            self._sources.append((block, query))
        self.dropped += queries - skip - count  # block rows that never fit
        self.keys = max(self.keys, keys)
        return skip

    def append_pooled(self, pooled: PooledBlock) -> bool:
        """Start an empty buffer with a prompt pooled by the engine: its pooled rows as
        placeholders, its tail rows as they are. False (nothing added) where the buffer holds
        rows already or would not keep every row of it: the rows themselves must come."""
        first = pooled.keys - pooled.queries
        if self._rows or pooled.queries > self.limit(pooled.keys):
            return False
        for query in range(pooled.queries):
            position = first + query
            tail = query - pooled.rows
            self._rows.append(None if tail < 0 else pooled.tail[:, tail, : position + 1])
            self._positions.append(position)
            self._sources.append(None)
        self.keys = max(self.keys, pooled.keys)
        self.pooled, self._pooled_dropped = pooled, self.dropped
        return True

    def fill_prompt(self, block: np.ndarray) -> bool:
        """Put a prompt's rows [heads, queries, keys] in place of their placeholders; True if
        any were filled."""
        waiting = self.placeholders
        if not waiting:
            return False
        first = block.shape[2] - block.shape[1]
        for index in range(waiting):
            query = self._positions[index] - first
            if not 0 <= query < block.shape[1]:
                return False
        for index in range(waiting):
            query = self._positions[index] - first
            self._rows[index] = block[:, query, : self._positions[index] + 1]
            self._sources[index] = (block, query)
        self.pooled = None
        self.filled += 1
        return True

    def append_row(self, row: np.ndarray) -> bool:
        """Append one decode row [heads, keys]; its query sits at position keys - 1.

        Returns False when the position was already present and the row was overwritten (the
        first token's row can repeat the last prompt row).
        """
        return self._append(row, row.shape[1] - 1)

    def row_at(self, position: int) -> np.ndarray | None:
        """The [heads, keys] weights of the query at context `position`, if kept (None also
        for a placeholder's: see `waits_for`)."""
        index = self.index_of(position)
        return None if index is None else self._rows[index]

    def index_of(self, position: int) -> int | None:
        """The row holding the query at context `position`, if kept."""
        for index in range(len(self._positions) - 1, -1, -1):
            if self._positions[index] == position:
                return index
        return None

    def waits_for(self, position: int) -> bool:
        """Whether the row of the query at `position` is a placeholder whose rows will come."""
        index = self.index_of(position)
        return index is not None and self._rows[index] is None and not self.prompt_gone

    def value(self, row: int, key: int, head: int) -> float:
        """The weight at (row, key) of `head`; NaN off the buffer or in a placeholder."""
        if 0 <= row < self.rows and 0 <= key < self.keys and 0 <= head < self.heads:
            weights = self._rows[row]
            if weights is None:
                return math.nan
            return float(weights[head, key]) if key < weights.shape[1] else 0.0
        return math.nan

    def _append(self, row: np.ndarray, position: int) -> bool:
        if self._positions and self._positions[-1] == position:
            self._rows[-1] = row
            self._sources[-1] = None
            new = False
        else:
            limit = self.limit(max(self.keys, row.shape[1]))
            if self.rows >= limit:
                self._drop(self.rows - limit + 1)  # at least half (see _drop)
            self._rows.append(row)
            self._positions.append(position)
            self._sources.append(None)
            new = True
        self.keys = max(self.keys, row.shape[1])
        return new

    def _drop(self, drop: int) -> None:
        """Forget the `drop` oldest rows (at least half: the view redraws less often), rounded
        up to whole blocks of DROP_BLOCK where that leaves any."""
        if drop <= 0:
            return
        drop = min(self.rows, max(drop, self.rows // 2))
        blocks = -(-drop // DROP_BLOCK) * DROP_BLOCK
        if blocks < self.rows:
            drop = blocks
        del self._rows[:drop]
        del self._positions[:drop]
        del self._sources[:drop]
        self.dropped += drop


# A prompt's rows are summed this many at a time, a short piece of work: summing a 512-row
# prefill block of four watched layers at once held the event loop up for far longer.
CHUNK_ROWS = 32
TINY = np.finfo(np.float32).tiny


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of attention rows, [heads, rows] each: the row's largest weight and
    its entropy normalized by the most it could have (uniform over its visible keys)."""

    max_weight: np.ndarray
    entropy: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.max_weight.shape[1])

    def tail(self, skip: int) -> RowStats:
        """Without the first `skip` rows."""
        return RowStats(self.max_weight[:, skip:], self.entropy[:, skip:])


def row_stats(
    rows: np.ndarray, positions: np.ndarray, scratch: np.ndarray | None = None
) -> RowStats:
    """RowStats of [heads, n, keys] rows whose queries sit at `positions` (any thread: pure
    numpy, so it can run beside the GUI thread). Keys past a chunk's last query are the
    causal mask's zeros and are left out: they add nothing to either statistic."""
    heads, count, _keys = rows.shape
    max_weight = np.zeros((heads, count))
    entropy = np.zeros((heads, count))
    for start in range(0, count, CHUNK_ROWS):
        end = min(start + CHUNK_ROWS, count)
        visible = int(positions[end - 1]) + 1
        weights = np.asarray(rows[:, start:end, :visible], dtype=np.float32)
        max_weight[:, start:end] = weights.max(axis=2)
        # -sum w log w, with 0 log 0 = 0: a zero weight times log(tiny) is exactly zero, so no
        # masked log (twice the cost) is needed. A batched matmul multiplies and sums each row
        # in one pass (half the time of einsum).
        size = weights.size
        if scratch is None or scratch.size < size:
            scratch = np.empty(size, dtype=np.float32)
        logs = scratch[:size].reshape(weights.shape)
        np.maximum(weights, TINY, out=logs)
        np.log(logs, out=logs)
        products = weights[:, :, None, :] @ logs[:, :, :, None]  # [heads, n, 1, 1]
        most = np.log(np.maximum(positions[start:end] + 1, 2).astype(np.float64))
        entropy[:, start:end] = -products[:, :, 0, 0].astype(np.float64) / most
    return RowStats(max_weight, entropy)


@dataclass
class HeadStats:
    """Running sums per head over every attention row seen, for the layer x head overview.

    Rows are summed as they are added, except blocks longer than CHUNK_ROWS (a prompt's
    matrix): those wait in `pending` and are summed a chunk at a time by `settle`, so no
    single event holds the GUI for long. Rows whose RowStats were worked out elsewhere (the
    thread that receives the engine's events: see PreparedStats) are added as they are.
    `mean` sums what still waits first: it is always the mean over every row added.
    """

    heads: int
    rows: int = 0
    max_weight: np.ndarray = field(init=False)
    entropy: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.max_weight = np.zeros(self.heads)
        self.entropy = np.zeros(self.heads)
        self._logs = np.empty(0, dtype=np.float32)  # scratch for row_stats
        self._pending: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (rows, positions)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def add(self, rows: np.ndarray, positions: np.ndarray) -> None:
        """Add [heads, n, keys] rows whose queries sit at `positions` (read-only arrays:
        a long block is kept, not copied, until it is summed)."""
        count = rows.shape[1]
        if count <= CHUNK_ROWS and not self._pending:
            self._sum(rows, positions)
            return
        for start in range(0, count, CHUNK_ROWS):
            end = start + CHUNK_ROWS
            self._pending.append((rows[:, start:end], positions[start:end]))

    def add_stats(self, stats: RowStats) -> None:
        """Add rows by their RowStats, worked out elsewhere (in order with `add`: what waits
        is summed first, so the sums never depend on which way rows came)."""
        self.settle()
        self.max_weight += stats.max_weight.sum(axis=1)
        self.entropy += stats.entropy.sum(axis=1)
        self.rows += stats.rows

    def settle(self, deadline: float | None = None) -> bool:
        """Sum waiting chunks until time.perf_counter() passes `deadline` (None: all of
        them); True once nothing waits."""
        while self._pending:
            self._sum(*self._pending.popleft())
            if deadline is not None and time.perf_counter() > deadline:
                break
        return not self._pending

    def _sum(self, rows: np.ndarray, positions: np.ndarray) -> None:
        if rows.shape[1] == 0:
            return
        size = rows.shape[0] * rows.shape[1] * rows.shape[2]
        if self._logs.size < size:  # kept: a new buffer per row is fresh memory every time
            self._logs = np.empty(max(size, 2 * self._logs.size), dtype=np.float32)
        stats = row_stats(rows, positions, self._logs)
        self.max_weight += stats.max_weight.sum(axis=1)
        self.entropy += stats.entropy.sum(axis=1)
        self.rows += stats.rows

    def mean(self, measure: str) -> np.ndarray:
        self.settle()
        values = self.entropy if measure == "entropy" else self.max_weight
        return values / self.rows if self.rows else np.zeros(self.heads)
