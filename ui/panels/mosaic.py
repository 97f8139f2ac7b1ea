"""The heads of a layer as one image: tiles in a grid with thin gaps, no Qt.

One ImageItem paints every head of a layer, so a frame costs one image upload instead of one
plot (axes, auto-range, layout) per head. `MosaicLayout` decides where each head's tile goes
and maps image pixels back to (head, row, key); `WeightHistogram` keeps the per-head colour
level (a high quantile of the weights shown) up to date as rows arrive.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

GAP = 0.03  # the gap between tiles, as a share of a tile's side
# Gaps (and places without a head) hold this value, below every weight. MOSAIC_LEVELS maps it
# to the first entry of the mosaic's colour table, kept for the background, and weights 0..1
# to the other 255 entries (0 lands in entry 1 with room to spare for rounding).
GAP_VALUE = -1.0
MOSAIC_LEVELS = (-1.5 / 255, 1.0)
MIN_TILE_PIXELS = 64  # a tile narrower than this is upsampled, so a one-pixel gap stays thin

# Colour levels: log-spaced bins over (0, 1]; weights below the first edge share its bin.
LEVEL_BINS = 256
LEVEL_EDGES = np.logspace(-5.0, 0.0, LEVEL_BINS + 1).astype(np.float32)
LEVEL_EDGES[0] = 0.0  # every nonzero weight falls in a bin


def best_columns(tiles: int, width: float, height: float, aspect: float = 1.0) -> int:
    """The number of tile columns whose tiles are largest on a `width` x `height` screen area.

    Each tile keeps `aspect` (its height / its width): with `columns` per line it is at most
    width / columns wide and height / lines / aspect wide; maximise that width (ties: fewer
    columns), so square-ish tiles win when they fit.
    """
    if tiles <= 1 or width <= 0 or height <= 0:
        return 1
    best, best_side = 1, -1.0
    for columns in range(1, tiles + 1):
        rows = math.ceil(tiles / columns)
        side = min(width / columns, height / rows / aspect)
        if side > best_side + 1e-9:
            best, best_side = columns, side
    return best


@dataclass(frozen=True)
class MosaicLayout:
    """Where each of `tiles` heads goes in the mosaic image, and how pixels map back.

    Each head's data is [rows, columns] (display cells); small data is repeated `upsample`
    times along each axis so gaps of one pixel stay thin beside it. Tiles are placed left to
    right, top to bottom, `columns_of_tiles` per line, `gap` pixels apart. Its sizes are
    worked out once per layout (a frame and each hover read them many times).
    """

    tiles: int
    data_rows: int
    data_columns: int
    columns_of_tiles: int

    @cached_property
    def lines_of_tiles(self) -> int:
        return max(math.ceil(self.tiles / self.columns_of_tiles), 1)

    @cached_property
    def upsample(self) -> tuple[int, int]:
        """(rows, columns) repeat factors of each data cell."""
        return (
            max(math.ceil(MIN_TILE_PIXELS / max(self.data_rows, 1)), 1),
            max(math.ceil(MIN_TILE_PIXELS / max(self.data_columns, 1)), 1),
        )

    @cached_property
    def tile_shape(self) -> tuple[int, int]:
        """A tile's (height, width) in image pixels."""
        up_rows, up_columns = self.upsample
        return self.data_rows * up_rows, self.data_columns * up_columns

    @cached_property
    def gap(self) -> tuple[int, int]:
        """The (vertical, horizontal) gap between tiles in image pixels."""
        height, width = self.tile_shape
        return max(round(height * GAP), 1), max(round(width * GAP), 1)

    @cached_property
    def shape(self) -> tuple[int, int]:
        """The whole image's (height, width) in pixels."""
        (height, width), (gap_y, gap_x) = self.tile_shape, self.gap
        lines, columns = self.lines_of_tiles, self.columns_of_tiles
        return lines * height + (lines - 1) * gap_y, columns * width + (columns - 1) * gap_x

    def origin(self, slot: int) -> tuple[int, int]:
        """The (y, x) pixel of tile `slot`'s top-left corner."""
        (height, width), (gap_y, gap_x) = self.tile_shape, self.gap
        line, column = divmod(slot, self.columns_of_tiles)
        return line * (height + gap_y), column * (width + gap_x)

    def locate(self, y: float, x: float) -> tuple[int, float, float] | None:
        """(slot, y, x inside that tile) for image pixel (y, x); None in a gap or outside."""
        (height, width), (gap_y, gap_x) = self.tile_shape, self.gap
        if y < 0 or x < 0:
            return None
        line, inside_y = divmod(y, height + gap_y)
        column, inside_x = divmod(x, width + gap_x)
        if inside_y >= height or inside_x >= width or column >= self.columns_of_tiles:
            return None
        slot = int(line) * self.columns_of_tiles + int(column)
        return (slot, inside_y, inside_x) if slot < self.tiles else None

    def compose(self, data: np.ndarray, scale: np.ndarray, out: np.ndarray | None) -> np.ndarray:
        """The mosaic of `data` [tiles, rows, columns], tile i multiplied by `scale[i]`.

        Reuses `out` when it has the right shape (gaps keep GAP_VALUE: they are never written).
        """
        if out is None or out.shape != self.shape:
            out = np.full(self.shape, GAP_VALUE, dtype=np.float32)
        height, width = self.tile_shape
        up_rows, up_columns = self.upsample
        rows, columns = self.data_rows, self.data_columns
        for slot in range(self.tiles):
            y, x = self.origin(slot)
            tile = out[y : y + height, x : x + width]
            # Each cell written straight into its up_rows x up_columns block: one pass, no
            # repeated copies (two np.repeat made two temporaries per tile).
            blocks = tile.reshape(rows, up_rows, columns, up_columns)
            np.multiply(data[slot][:, None, :, None], scale[slot], out=blocks)
        return out

    def tile(self, image: np.ndarray, slot: int) -> np.ndarray:
        """Tile `slot` of a composed image, back at one pixel per data cell."""
        height, width = self.tile_shape
        up_rows, up_columns = self.upsample
        y, x = self.origin(slot)
        return image[y : y + height : up_rows, x : x + width : up_columns]


_LOW_EXPONENT = -5.0  # log10 of LEVEL_EDGES[1]


def mosaic_colours(table: np.ndarray, background: tuple[int, ...]) -> np.ndarray:
    """A 256-entry table: `background` for gaps, then `table` squeezed into the other 255."""
    picks = np.linspace(0, len(table) - 1, 255).round().astype(int)
    colours = np.empty((256, table.shape[1]), dtype=table.dtype)
    colours[0] = background[: table.shape[1]]
    colours[1:] = table[picks]
    return colours


def level_bins(values: np.ndarray) -> np.ndarray:
    """The LEVEL_EDGES bin of each value (same rule as np.histogram: [a, b), the last closed).

    The log gives the bin up to rounding; one comparison with each neighbouring edge settles
    values that rounding put on the wrong side (a search over the edges costs 5x more).
    """
    logs = np.log10(np.maximum(values, LEVEL_EDGES[1] / 2, dtype=np.float32))
    bins: np.ndarray = ((logs - _LOW_EXPONENT) * (LEVEL_BINS / -_LOW_EXPONENT)).astype(np.intp) + 1
    np.clip(bins, 0, LEVEL_BINS - 1, out=bins)
    bins -= values < LEVEL_EDGES[bins]
    bins += (values >= LEVEL_EDGES[bins + 1]) & (bins < LEVEL_BINS - 1)
    return bins


def histograms(block: np.ndarray) -> np.ndarray:
    """Counts [heads, rows, LEVEL_BINS] of the nonzero weights of each row of [heads, rows, n]."""
    heads, rows, _columns = block.shape
    bins = level_bins(block)
    bins += (np.arange(heads * rows).reshape(heads, rows, 1) * LEVEL_BINS).astype(bins.dtype)
    counts = np.bincount(bins[block > 0], minlength=heads * rows * LEVEL_BINS)
    return counts.reshape(heads, rows, LEVEL_BINS)


class WeightHistogram:
    """Per-head counts of the nonzero weights in the rows of a display buffer.

    The owner tells it which rows it rewrote (`set_rows`), dropped from the top (`shift`) or
    cleared (`reset`); each costs only those rows. `level` reads a quantile from the counts,
    so the colour scale needs no pass over the whole image per frame.
    """

    def __init__(self, heads: int, capacity: int) -> None:
        self.per_row = np.zeros((heads, capacity, LEVEL_BINS), dtype=np.int32)
        self.total = np.zeros((heads, LEVEL_BINS), dtype=np.int64)

    def reset(self) -> None:
        self.per_row[...] = 0
        self.total[...] = 0

    def set_rows(self, first: int, block: np.ndarray) -> None:
        """Rows first.. of the buffer now hold `block` [heads, rows, n]."""
        counts = histograms(block)
        end = first + counts.shape[1]
        self.total -= self.per_row[:, first:end].sum(axis=1)
        self.total += counts.sum(axis=1)
        self.per_row[:, first:end] = counts

    def shift(self, rows: int, used: int) -> None:
        """The top `rows` rows left the buffer; the rest of the `used` ones moved up. Rows past
        `used` hold no counts and stay as they are."""
        used = min(used, self.per_row.shape[1])
        self.total -= self.per_row[:, :rows].sum(axis=1)
        kept = max(used - rows, 0)
        self.per_row[:, :kept] = self.per_row[:, rows:used]
        self.per_row[:, kept:used] = 0

    def level(self, quantile: float = 0.99) -> np.ndarray:
        """Per head: the `quantile` of its nonzero weights, to one bin (1.0 where none).

        Interpolated in log space inside the bin that holds the quantile, so it lies within
        that bin's edges of the exact value.
        """
        counts = self.total
        totals = counts.sum(axis=1)
        levels = np.ones(counts.shape[0], dtype=np.float64)
        cumulative = np.cumsum(counts, axis=1)
        for head, total in enumerate(totals):
            if total == 0:
                continue
            rank = quantile * (total - 1) + 1  # np.quantile's linear rank, 1-based
            index = int(np.searchsorted(cumulative[head], rank, side="left"))
            index = min(index, LEVEL_BINS - 1)
            before = cumulative[head, index - 1] if index else 0
            share = (rank - before) / max(counts[head, index], 1)
            low = max(float(LEVEL_EDGES[index]), float(LEVEL_EDGES[1]) / 10)
            high = float(LEVEL_EDGES[index + 1])
            levels[head] = low * (high / low) ** min(max(share, 0.0), 1.0)
        return levels
