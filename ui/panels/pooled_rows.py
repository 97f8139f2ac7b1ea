"""One layer's attention rows max-pooled for display: at most DISPLAY_ROWS x DISPLAY_KEYS cells
per head, pooled as rows arrive, with a histogram of the cells for the colour levels.

Plain numpy, no Qt (an import-linter contract holds it to that): the attention panel draws
what this returns, and the tests hold it to a full max-pool of every row.
"""

from __future__ import annotations

import math

import numpy as np

from engine.attention_pooling import (
    PROMPT_PIECE,
    max_pool_keys,
    max_pool_rows,
    pool_factor,
    pool_prompt_rows,
)
from engine.events import PooledBlock
from ui.panels.mosaic import WeightHistogram
from ui.panels.state import AttentionRows

# Bounded work per frame: rows and keys past these are max-pooled into one image cell.
DISPLAY_ROWS = 256
DISPLAY_KEYS = 512
POOL_CHUNK = 32  # rows pooled per dense copy when the whole view is pooled again
LEVEL_QUANTILE = 0.99  # "scale each head": its top colour is this quantile of its weights


def pooled_further(
    pooled: PooledBlock,
    first: int,
    end: int,
    row_factor: int,
    key_factor: int,
    columns: int,
) -> np.ndarray | None:
    """Rows `first`..`end` of a prompt the engine pooled, pooled on to runs of `row_factor`
    rows (the first starting at `first`) and `key_factor` keys: [heads, runs, columns]. None
    where the engine's factors do not divide these or its runs do not start at `first`."""
    rows_up, keys_up = row_factor // pooled.row_factor, key_factor // pooled.key_factor
    if first % pooled.row_factor or not rows_up or not keys_up:
        return None
    if row_factor % pooled.row_factor or key_factor % pooled.key_factor:
        return None
    cells = pooled.cells[:, first // pooled.row_factor : -(-end // pooled.row_factor)]
    wide = np.zeros((cells.shape[0], cells.shape[1], columns * keys_up), dtype=np.float32)
    kept = min(cells.shape[2], wide.shape[2])  # keys past the prompt's are zeros
    wide[:, :, :kept] = cells[:, :, :kept]
    return max_pool_keys(max_pool_rows(wide, rows_up), keys_up)


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
        # Cells left without a pooled prompt's share: its factors do not divide these. The
        # panel then asks for the prompt's rows, and pools again once they filled the buffer.
        self.missing = False
        self._filled = 0  # the rows' `filled` when the cells went missing

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
        came = self.missing and self._rows_came(rows)  # what the cells lacked is here
        if key != self._key or shift % row_factor or not 0 <= shift <= self._rows or came:
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
        if start < rows.placeholders:
            return self._pool_placeholders(rows, start, end, row_factor, key_factor, columns)
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

    def _pool_placeholders(
        self,
        rows: AttentionRows,
        start: int,
        end: int,
        row_factor: int,
        key_factor: int,
        columns: int,
    ) -> int:
        """Pool the runs of rows from `start` (a run's first, a placeholder) through the run
        where the placeholders end (or `end`): the pooled prompt's cells pooled further, and the
        rows that are here in the last run; returns where the piece ended. Where the pooled
        factors do not divide this pooling's, the placeholders' share is left out (`missing`)."""
        pooled, offset, waiting = rows.pooled, rows.pooled_offset, rows.placeholders
        assert pooled is not None  # there are placeholders
        stop = min(end, math.ceil(waiting / row_factor) * row_factor)
        blocks = math.ceil((stop - start) / row_factor)
        target = self._data[:, start // row_factor : start // row_factor + blocks, :columns]
        target[:] = 0.0
        if stop > waiting:  # the last run's rows that are here: zeros for its placeholders
            run = (waiting // row_factor) * row_factor
            source = rows.padded(run, columns * key_factor, stop)
            target[:, -1] = max_pool_keys(max_pool_rows(source, row_factor), key_factor)[:, 0]
        share = pooled_further(
            pooled, start + offset, min(stop, waiting) + offset, row_factor, key_factor, columns
        )
        if share is None:
            if not self.missing:
                self.missing, self._filled = True, rows.filled
            return stop
        part = target[:, : share.shape[1]]
        np.maximum(part, share, out=part)
        return stop

    def _rows_came(self, rows: AttentionRows) -> bool:
        """Whether the rows behind missing cells are here now (or were dropped)."""
        return rows.filled != self._filled or not rows.placeholders

    def extend(self, rows: AttentionRows) -> bool:
        """Pool the rows that arrived since the last `update`, with its cell bounds, unless the
        pooling would start over (a new reply, new factors): that is left to the next `update`.

        Called as events arrive, so a frame finds its new rows pooled: the work comes in one
        small piece per delivered batch instead of one long one per frame. True if it pooled.
        """
        if not self._key or (self.missing and self._rows_came(rows)):
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
        self.missing = False

    def _shift(self, blocks: int, used: int) -> None:
        """Move the pooled blocks up by `blocks`, of the `used` filled ones: only the filled
        cells move (the rest of the buffer is zero), a fraction of the whole buffer."""
        used = min(used, self._data.shape[1])
        kept = max(used - blocks, 0)
        filled = self._data[:, :, : self._columns]
        filled[:, :kept] = filled[:, blocks:used]  # numpy copies overlapping views safely
        filled[:, kept:used] = 0.0
        self.histogram.shift(blocks, used)
