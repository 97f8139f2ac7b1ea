"""Attention rows max-pooled to a grid of display cells: the attention mosaic's pooling.

The window pools the rows it holds (ui/panels/pooled_rows.py); the engine's server pools a
prompt's matrix before it crosses to the window (`pool_prompt`), so a panel a few hundred
cells wide gets a few hundred KB at the reply's start instead of the 10 MB of a 1,000-token
prompt's rows, which the window would read, pool and free while the model decodes beside it.
Max-pooling is exact in any order: a run pooled here and pooled further there equals the run
pooled once. Plain numpy (app/ and ui/ import it; no torch).
"""

from __future__ import annotations

import math

import numpy as np

from engine.events import PooledBlock, frozen_array

PROMPT_PIECE = 64  # a prompt block's rows pooled at once: its ragged keys copied are ~this many


def pool_factor(count: int, cells: int) -> int:
    """How many rows (or keys) one of at most `cells` cells covers: a power of two.

    A new factor pools every row again (tens of milliseconds at 10,000 keys); powers of two
    change it once per doubling of the context instead of every `cells` tokens, and a finer
    pooling always divides a coarser one.
    """
    return 1 << max(math.ceil(count / cells) - 1, 0).bit_length()


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
    position) into `target` [heads, row blocks, key blocks].

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


def pool_prompt(block: np.ndarray, grid: tuple[int, int]) -> PooledBlock | None:
    """A prompt's matrix [heads, queries, keys] pooled for a mosaic whose tiles hold at most
    `grid` (rows, keys) cells; None where pooling would not make it smaller.

    The factors are one power of two finer than that grid needs: the panel's grid moves with
    the tile's shape (the rows it holds drop by half at the first decoded token), and it pools
    the cells further by whatever power of two it then needs; it could not pool them finer.
    The last query rows stay as they are, at least one and the rest of a run of `row_factor`:
    a decoded row rewrites the last and joins the last run.
    """
    heads, queries, keys = block.shape
    row_factor = max(pool_factor(queries, max(grid[0], 1)) // 2, 1)
    key_factor = max(pool_factor(keys, max(grid[1], 1)) // 2, 1)
    rows = (queries - 1) // row_factor * row_factor
    if row_factor * key_factor == 1 or rows == 0:
        return None
    cells = np.zeros((heads, rows // row_factor, math.ceil(keys / key_factor)), np.float32)
    piece = max(PROMPT_PIECE // row_factor, 1) * row_factor
    for start in range(0, rows, piece):
        count = min(piece, rows - start)
        target = cells[:, start // row_factor : (start + count) // row_factor]
        pool_prompt_rows(target, block, start, count, row_factor, key_factor)
    cells.setflags(write=False)
    return PooledBlock(cells, row_factor, key_factor, frozen_array(block[:, rows:]))
