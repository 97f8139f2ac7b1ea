"""The attention mosaic's pieces that need no panel: its colours (and the overview's), token
text for the axes, a tile's shape on screen, the outline of a query row and the hover line of a
cell."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF
from PySide6.QtGui import QImage, QPainterPath

from ui.panels.mosaic import MosaicLayout
from ui.panels.state import AttentionRows

# A tile keeps its rows x keys shape on screen (square cells for the prompt's matrix) unless
# that would make it flatter than this: then the rows stretch, so a long context's latest
# rows stay readable.
FLATTEST_TILE = 0.25
TOKEN_LABEL_CHARACTERS = 8


def colour_table() -> np.ndarray:
    return np.asarray(pg.colormap.get("viridis").getLookupTable(nPts=256))


def argb_table(lut: np.ndarray) -> list[int]:
    """0xAARRGGBB of each row of an RGB(A) colour table, opaque: a QImage's colour table."""
    rgb = np.asarray(lut, dtype=np.uint32)[:, :3]
    return [int(c) for c in 0xFF000000 | (rgb[:, 0] << 16) | (rgb[:, 1] << 8) | rgb[:, 2]]


def table_pixels(index: np.ndarray, colours: list[int]) -> QImage:
    """Entries [rows, columns] (uint8) of `colours` as 32-bit pixels. Qt paints an Indexed8
    image by converting it at every paint, in its thread pool, whose threads take the model's
    cores: converted here once per new picture, each paint is a plain (scaled) copy."""
    index = np.ascontiguousarray(index, dtype=np.uint8)
    rows, columns = index.shape
    picture = QImage(index.data, columns, rows, columns, QImage.Format.Format_Indexed8)
    picture.setColorTable(colours)
    return picture.convertToFormat(QImage.Format.Format_RGB32)  # copies the pixels


def display_token(text: str) -> str:
    return repr(text)[1:-1] if text.strip() else repr(text)


def axis_token(text: str) -> str:
    shown = display_token(text)
    if len(shown) <= TOKEN_LABEL_CHARACTERS:
        return shown
    return shown[: TOKEN_LABEL_CHARACTERS - 1] + "…"


def tile_aspect(rows: int, keys: int) -> float:
    """A tile's height / width on screen: its rows / keys, but never flatter than FLATTEST_TILE."""
    return min(max(rows / max(keys, 1), FLATTEST_TILE), 1.0)


def row_path(
    layout: MosaicLayout, pixel: tuple[float, float], tiles: int, row: int
) -> QPainterPath:
    """Row `row` outlined on each of the first `tiles` tiles; `pixel`: a key's and a row's
    size in view units."""
    key_size, row_size = pixel
    tile_width = layout.tile_shape[1]
    path = QPainterPath()
    for slot in range(tiles):
        y, x = layout.origin(slot)
        path.addRect(QRectF(x * key_size, y * row_size + row, tile_width * key_size, 1.0))
    return path


def describe_cell(
    token_text: Callable[[int], str], rows: AttentionRows, head: int, row: int, key: int
) -> str:
    """The hover line for one cell of a layer's rows (row: index into its buffer)."""
    query = int(rows.positions[row])
    if key > query:
        return f"head {head} · query #{query} cannot see key #{key} (causal mask)"
    value = rows.value(row, key, head)
    if not math.isnan(value):
        weight = f"{value:.4f}"
    elif rows.prompt_gone:
        weight = "(the prompt's weights have left the engine's memory)"
    else:
        weight = "(the prompt's weights are on their way)"
    return (
        f"head {head} · query #{query} '{display_token(token_text(query))}' → "
        f"key #{key} '{display_token(token_text(key))}': {weight}"
    )
