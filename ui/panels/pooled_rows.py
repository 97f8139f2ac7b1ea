"""One layer's attention rows max-pooled for display: at most DISPLAY_ROWS x DISPLAY_KEYS cells
per head, pooled as rows arrive, with a histogram of the cells for the colour levels.

Plain numpy, no Qt (an import-linter contract holds it to that): the attention panel draws
what this returns, and the tests hold it to a full max-pool of every row.
"""

from __future__ import annotations

import math

import numpy as np

from ui.panels.mosaic import WeightHistogram
from ui.panels.state import AttentionRows

# Bounded work per frame: rows and keys past these are max-pooled into one image cell.
DISPLAY_ROWS = 256
DISPLAY_KEYS = 512
POOL_CHUNK = 32  # rows pooled per dense copy when the whole view is pooled again
PROMPT_PIECE = 64  # a prompt block's rows pooled at once: its ragged keys copied are ~this many
LEVEL_QUANTILE = 0.99  # "scale each head": its top colour is this quantile of its weights


def max_pool_keys(block: np.ndarray, factor: int) -> np.ndarray:
    """Max over each run of `factor` keys of [heads, rows, columns * factor].

    An even factor is halved pass by pass, each pass one call over neighbouring pairs: it reads
    its input once and leaves half as much for the next, where a strided pass per key of a run
    reads every cache line of the block each time. An odd factor left over takes the largest
    of its runs in strided passes, or one reduction call from 24 on. Factor 1: `block` itself.
    """
    out = block
    while factor % 2 == 0:
        out = np.maximum(out[:, :, 0::2], out[:, :, 1::2])
        factor //= 2
    if factor == 1:
        return out
    if factor >= 24:  # one reduction call beats `factor` strided ones (5x at 64)
        return np.maximum.reduceat(out, np.arange(0, out.shape[2], factor), axis=2)
    pooled = out[:, :, 0::factor].copy()
    for offset in range(1, factor):
        np.maximum(pooled, out[:, :, offset::factor], out=pooled)
    return pooled


def max_pool_rows(block: np.ndarray, factor: int) -> np.ndarray:
    """Max over each run of `factor` rows of [heads, rows, keys], the last run maybe shorter.

    Rows before keys: runs of whole rows are contiguous, so this halves (or more) what the
    strided pass over keys reads, and max does not care which comes first."""
    if factor == 1:
        return block
    out = block[:, 0::factor].copy()
    for offset in range(1, factor):
        part = block[:, offset::factor]
        runs = part.shape[1]  # one fewer than out's where the last run is short
        np.maximum(out[:, :runs], part, out=out[:, :runs])
    return out


def pool_prompt_rows(
    target: np.ndarray,
    block: np.ndarray,
    query: int,
    count: int,
    row_factor: int,
    key_factor: int,
) -> None:
    """Max-pool a prompt block's rows `query`.. (`count` of them, zeros past each row's own
    position as AttentionRows pads them) into `target` [heads, row blocks, key blocks].

    Up to the first row's position every row's weights are the block's own: pooled in place,
    no copy. Only the ragged keys past it (about `count` of them) are copied and zeroed
    where a row ends, whatever the block holds there."""
    width = target.shape[2] * key_factor
    first_position = block.shape[2] - block.shape[1] + query
    shared = min(first_position + 1, width) // key_factor * key_factor
    if shared:
        direct = block[:, query : query + count, :shared]
        target[:, :, : shared // key_factor] = max_pool_keys(
            max_pool_rows(direct, row_factor), key_factor
        )
    if shared == width:
        return
    tail = np.zeros((block.shape[0], count, width - shared), dtype=np.float32)
    available = min(block.shape[2], width) - shared
    tail[:, :, :available] = block[:, query : query + count, shared : shared + available]
    positions = np.arange(first_position, first_position + count)
    past = shared + np.arange(width - shared)[None, :] > positions[:, None]
    np.copyto(tail, 0.0, where=past)  # broadcast over the heads
    pooled = max_pool_keys(max_pool_rows(tail, row_factor), key_factor)
    target[:, :, shared // key_factor :] = pooled


def pool_factor(count: int, cells: int) -> int:
    """How many rows (or keys) one of at most `cells` cells covers: a power of two.

    A new factor pools every row again (tens of milliseconds at 10,000 keys); powers of two
    change it once per doubling of the context instead of every `cells` tokens.
    """
    return 1 << max(math.ceil(count / cells) - 1, 0).bit_length()


class PooledRows:
    """A display copy of one layer's rows, max-pooled to at most DISPLAY_ROWS x DISPLAY_KEYS
    cells (or fewer, as `update` asks).

    Rows only ever change at the bottom (a new row, or the last one rewritten), so each frame
    pools just the rows since the last pooled block; rows dropped from the top shift the pooled
    blocks up. A new reply or new pooling factors start it over, pooling POOL_CHUNK rows at a
    time so a long context never needs a dense copy of every row. Max-pooling keeps a lone
    strong weight visible however far it zooms out.
    """

    def __init__(self) -> None:
        self._key: tuple[int, ...] = ()
        self._grid = (DISPLAY_ROWS, DISPLAY_KEYS)  # the cell bounds of the last update
        self._data = np.zeros((0, 0, 0), dtype=np.float32)
        self._rows = 0
        self._columns = 0  # the key blocks written since the buffer was cleared
        self._blocks = 0  # and the row blocks: the cells to clear for the next pooling
        self._dropped = 0
        self.histogram = WeightHistogram(0, 0)  # of the pooled cells, for the colour levels
        self._scratch = np.empty(0, dtype=np.float32)  # the dense rows of one chunk

    def update(
        self,
        rows: AttentionRows,
        max_rows: int | None = None,
        max_keys: int | None = None,
        whole_blocks: bool = False,
    ) -> tuple[np.ndarray, int, int]:
        """The pooled [heads, row blocks, key blocks] and how many rows and keys a cell covers.

        `max_rows` and `max_keys` (at most DISPLAY_ROWS and DISPLAY_KEYS) bound the cells.
        `whole_blocks` pools only up to the last full block of rows (a partial block is pooled
        again with each row that joins it).
        """
        max_rows = min(max_rows or DISPLAY_ROWS, DISPLAY_ROWS)
        max_keys = min(max_keys or DISPLAY_KEYS, DISPLAY_KEYS)
        self._grid = (max_rows, max_keys)
        key, shift = self._plan(rows, max_rows, max_keys)
        row_factor, key_factor = key[3], key[4]
        if key != self._key or shift % row_factor or not 0 <= shift <= self._rows:
            self._clear(rows.heads)
            self._key, self._rows = key, 0
        elif shift:
            self._shift(shift // row_factor, math.ceil(self._rows / row_factor))
            self._rows -= shift
        self._dropped = rows.dropped
        self._rows = min(self._rows, rows.rows)
        columns = math.ceil(rows.keys / key_factor)
        blocks = math.ceil(rows.rows / row_factor)
        chunk = row_factor * max(POOL_CHUNK // row_factor, 1)
        first = max(self._rows - 1, 0) // row_factor  # the block holding the last row seen
        end = rows.rows - rows.rows % row_factor if whole_blocks else rows.rows
        size = rows.heads * chunk * columns * key_factor
        if self._scratch.size < size:
            self._scratch = np.empty(size, dtype=np.float32)
        start = first * row_factor
        while start < end:  # each piece starts at a block of rows
            last = self._pool_piece(rows, start, end, chunk, row_factor, key_factor, columns)
            block, blocks_pooled = start // row_factor, math.ceil((last - start) / row_factor)
            self.histogram.set_rows(block, self._data[:, block : block + blocks_pooled, :columns])
            self._blocks = max(self._blocks, block + blocks_pooled)
            start = last
        self._rows = max(end, self._rows)
        self._columns = max(self._columns, columns)
        return self._data[:, :blocks, :columns], row_factor, key_factor

    def _pool_piece(
        self,
        rows: AttentionRows,
        start: int,
        end: int,
        chunk: int,
        row_factor: int,
        key_factor: int,
        columns: int,
    ) -> int:
        """Pool the rows from `start` (a block's first) into the buffer; returns where the
        piece ended: a run of a prompt block's rows up to PROMPT_PIECE rows (whole blocks
        of rows, or up to `end`), else `chunk` rows through a dense copy."""
        block_row, width = start // row_factor, columns * key_factor
        run = rows.prompt_run(start, min(end, start + PROMPT_PIECE))
        if run is not None:
            block, query, count = run
            if start + count < end:
                count -= count % row_factor
            if count:
                blocks = math.ceil(count / row_factor)
                target = self._data[:, block_row : block_row + blocks, :columns]
                pool_prompt_rows(target, block, query, count, row_factor, key_factor)
                return start + count
        last = min(start + chunk, end)
        source = rows.padded(start, width, last, self._scratch)
        pooled = max_pool_keys(max_pool_rows(source, row_factor), key_factor)
        self._data[:, block_row : block_row + pooled.shape[1], :columns] = pooled
        return last

    def extend(self, rows: AttentionRows) -> bool:
        """Pool the rows that arrived since the last `update`, with its cell bounds, unless the
        pooling would start over (a new reply, new factors): that is left to the next `update`.

        Called as events arrive, so a frame finds its new rows pooled: the work comes in one
        small piece per delivered batch instead of one long one per frame. True if it pooled.
        """
        if not self._key:
            return False
        key, shift = self._plan(rows, *self._grid)
        if key != self._key or shift % key[3] or not 0 <= shift <= self._rows:
            return False
        if rows.rows - rows.rows % key[3] <= self._rows - shift and not shift:
            return False  # no new full block
        self.update(rows, *self._grid, whole_blocks=True)
        return True

    def _plan(
        self, rows: AttentionRows, max_rows: int, max_keys: int
    ) -> tuple[tuple[int, int, int, int, int], int]:
        """The pooling key (serial, heads, max_rows, row and key factors) and the rows dropped
        from the top since the last pooling."""
        # The buffer fills, then drops its older half, every max_rows / 2 tokens: a row factor
        # that followed it down would pool every row again each time. It only grows per reply.
        row_factor = pool_factor(rows.rows, max_rows)
        if self._key[:3] == (rows.serial, rows.heads, max_rows):
            row_factor = max(row_factor, self._key[3])
        # ... except where a longer context keeps fewer rows (AttentionRows.limit): 52 rows
        # at 10,000 keys pooled by the 8 that 256 needed would fill 7 cells of a tile.
        row_factor = min(row_factor, pool_factor(rows.limit(rows.keys), max_rows))
        key_factor = pool_factor(rows.keys, max_keys)
        key = (rows.serial, rows.heads, max_rows, row_factor, key_factor)
        return key, rows.dropped - self._dropped

    def levels(self, quantile: float = LEVEL_QUANTILE) -> np.ndarray:
        """Per head, the top colour level: a high quantile of its nonzero pooled weights.

        Not the max: the first query can only attend to itself (weight 1), which would leave
        everything else dark. Read from a histogram kept as cells are pooled, not by sorting
        the image every frame.
        """
        return self.histogram.level(quantile)

    def _clear(self, heads: int) -> None:
        """Start over: the written cells zeroed in the buffer kept (a new one for a new head
        count). A fresh 4.7 MB buffer per reply cost a page fault for every 4 KB written."""
        if self._data.shape[0] != heads:
            self._data = np.zeros((heads, DISPLAY_ROWS, DISPLAY_KEYS), dtype=np.float32)
            self.histogram = WeightHistogram(heads, DISPLAY_ROWS)
        else:
            self._data[:, : self._blocks, : self._columns] = 0.0
            self.histogram.reset()
        self._blocks = self._columns = 0

    def _shift(self, blocks: int, used: int) -> None:
        """Move the pooled blocks up by `blocks`, of the `used` filled ones: only the filled
        cells move (the rest of the buffer is zero), a fraction of the whole buffer."""
        used = min(used, self._data.shape[1])
        kept = max(used - blocks, 0)
        filled = self._data[:, :, : self._columns]
        filled[:, :kept] = filled[:, blocks:used]  # numpy copies overlapping views safely
        filled[:, kept:used] = 0.0
        self.histogram.shift(blocks, used)
