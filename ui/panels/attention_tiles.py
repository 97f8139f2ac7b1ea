"""The attention mosaic's pieces that need no panel: its colours, a head's label on its tile,
token text for the axes, a tile's shape on screen and the outline of a query row."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QFontMetricsF, QPainter, QPainterPath, QPen
from PySide6.QtWidgets import QGraphicsItem, QGraphicsPathItem

from ui.panels.mosaic import MosaicLayout
from ui.panels.state import AttentionRows

# A tile keeps its rows x keys shape on screen (square cells for the prompt's matrix) unless
# that would make it flatter than this: then the rows stretch, so a long context's latest
# rows stay readable.
FLATTEST_TILE = 0.25
TOKEN_LABEL_CHARACTERS = 8
# The selected step's query row, outlined on every tile (a cosmetic pen: pixels, not rows).
ROW_MARKER = QColor(255, 120, 0)
ROW_MARKER_PIXELS = 2


def colour_table() -> np.ndarray:
    return np.asarray(pg.colormap.get("viridis").getLookupTable(nPts=256))


class TileLabel(QGraphicsItem):
    """A head's name at its tile's top-right corner, at screen size whatever the view's scale.

    Qt places it (ItemIgnoresTransformations): a pg.TextItem worked out its own transform in
    Python at every change of the view's range and at every paint, about a fifth of the
    mosaic's paint while the range grew with each token.
    """

    PAD = 2.0
    FILL = QColor(0, 0, 0, 150)
    PEN = QColor(255, 255, 255)

    def __init__(self, font: QFont) -> None:
        super().__init__()
        self.setFlag(QGraphicsItem.GraphicsItemFlag.ItemIgnoresTransformations)
        self._font = font
        self._text = ""
        self._rect = QRectF()

    def setText(self, text: str) -> None:
        if text == self._text:
            return
        self.prepareGeometryChange()
        self._text = text
        metrics = QFontMetricsF(self._font)
        width = metrics.horizontalAdvance(text) + 2 * self.PAD
        self._rect = QRectF(-width, 0.0, width, metrics.height() + 2 * self.PAD)  # anchor (1, 0)
        self.update()

    def toPlainText(self) -> str:
        return self._text

    def boundingRect(self) -> QRectF:
        return self._rect

    def paint(self, painter: QPainter, _option: object, _widget: object = None) -> None:
        painter.fillRect(self._rect, self.FILL)
        painter.setFont(self._font)
        painter.setPen(self.PEN)
        painter.drawText(self._rect, Qt.AlignmentFlag.AlignCenter, self._text)


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


def row_marker() -> QGraphicsPathItem:
    """The item that outlines the selected step's row (hidden until there is one)."""
    marker = QGraphicsPathItem()
    pen = QPen(ROW_MARKER, ROW_MARKER_PIXELS)
    pen.setCosmetic(True)
    marker.setPen(pen)
    marker.setZValue(2)
    marker.setVisible(False)
    return marker


def describe_cell(
    token_text: Callable[[int], str], rows: AttentionRows, head: int, row: int, key: int
) -> str:
    """The hover line for one cell of a layer's rows (row: index into its buffer)."""
    query = int(rows.positions[row])
    if key > query:
        return f"head {head} · query #{query} cannot see key #{key} (causal mask)"
    return (
        f"head {head} · query #{query} '{display_token(token_text(query))}' → "
        f"key #{key} '{display_token(token_text(key))}': "
        f"{rows.value(row, key, head):.4f}"
    )
