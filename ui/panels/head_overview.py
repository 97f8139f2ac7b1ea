"""The attention panel's overview: every watched layer x head as one image, coloured by a mean
over the reply's rows (how much of a row its strongest key takes, or how evenly it spreads);
a click on a cell opens that head in the mosaic above it.

The grid is painted directly (`OverviewGrid`): its axes and labels kept as pixels until its
size or shape changes, a paint is then one scaled copy of a few dozen cells. As a pyqtgraph
plot each new picture repainted its scene, axes included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, Signal
from PySide6.QtGui import (
    QFontMetrics,
    QImage,
    QMouseEvent,
    QPainter,
    QPaintEvent,
    QResizeEvent,
)
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QSizePolicy,
    QVBoxLayout,
    QWidget,
)

from ui.panels.attention_tiles import argb_table, table_pixels
from ui.panels.line_chart import GRID, TEXT, KeptFrame
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import Throttle
from ui.panels.state import InternalsState

# The overview's means move by a hair per token: it redraws at most this often (and at once
# when its layers, its measure or its size change). Every frame, it was a second plot to
# repaint in this panel while the mosaic, what a reader watches, changed.
OVERVIEW_INTERVAL_S = 1.0
MEASURES = {"mean max weight": "max", "mean entropy (normalized)": "entropy"}
MEANINGS = {
    "max": "how much of a row goes to its single strongest key (1: all of it)",
    "entropy": "how evenly a row spreads over the keys it sees (1: uniformly, 0: one key)",
}


def label_step(count: int, pixels: float, label_pixels: float) -> int:
    """Label every `step`-th of `count` cells spread over `pixels` so labels do not collide."""
    if count <= 0 or pixels <= 0:
        return 1
    return max(math.ceil(label_pixels / (pixels / count)), 1)


class OverviewGrid(QWidget):
    """Rows (layers) x columns (heads) of values, coloured through `lut` from `levels`, with
    labelled axes. `image` is the grid as last set (None: nothing to show)."""

    clicked = Signal(int, int)  # (row, column) of the cell clicked
    resized = Signal()

    def __init__(self, lut: np.ndarray, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.image: np.ndarray | None = None
        self._colours = argb_table(lut)
        self._picture: QImage | None = None
        self.row_labels: tuple[tuple[int, str], ...] = ()  # (row, text) of the labelled rows
        self.column_labels: tuple[tuple[int, str], ...] = ()
        self._frame = KeptFrame()  # the background, axes and labels
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def set_image(self, grid: np.ndarray, levels: tuple[float, float]) -> None:
        """Show `grid` [rows, columns], `levels[0]` darkest and `levels[1]` brightest."""
        self.image = grid
        low, high = levels
        last = len(self._colours) - 1
        index = np.clip((grid - low) / (high - low) * last, 0, last).astype(np.uint8)
        self._picture = table_pixels(index, self._colours)
        self.update()

    def clear(self) -> None:
        self.image, self._picture = None, None
        self.update()

    def set_labels(
        self, rows: Sequence[tuple[int, str]], columns: Sequence[tuple[int, str]]
    ) -> None:
        self.row_labels, self.column_labels = tuple(rows), tuple(columns)
        self.update()

    def plot_rect(self) -> QRectF:
        """Where the cells are drawn: right of the layer labels, over the head labels."""
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        left = metrics.horizontalAdvance("layer 00") + 8
        return QRectF(
            left, 4, max(self.width() - left - 8, 1), max(self.height() - 2 * line - 10, 1)
        )

    def cell_at(self, point: QPointF) -> tuple[int, int] | None:
        """The (row, column) under a point of the widget, if any."""
        if self.image is None:
            return None
        area = self.plot_rect()
        if not area.contains(point):
            return None
        rows, columns = self.image.shape
        row = math.floor((point.y() - area.top()) / area.height() * rows)
        column = math.floor((point.x() - area.left()) / area.width() * columns)
        return (row, column) if 0 <= row < rows and 0 <= column < columns else None

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self.resized.emit()

    def mousePressEvent(self, event: QMouseEvent) -> None:
        cell = self.cell_at(event.position())
        if cell is not None and event.button() == Qt.MouseButton.LeftButton:
            self.clicked.emit(*cell)
        super().mousePressEvent(event)

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        shape = None if self.image is None else self.image.shape
        key = (shape, self.row_labels, self.column_labels)
        painter.drawPixmap(0, 0, self._frame.get(self, key, self._draw_axes))
        if self._picture is not None:
            painter.drawImage(self.plot_rect(), self._picture)
        painter.end()

    def _draw_axes(self, painter: QPainter) -> None:
        shape = None if self.image is None else self.image.shape
        area = self.plot_rect()
        line = painter.fontMetrics().height()
        painter.setPen(GRID)
        painter.drawRect(area.adjusted(-1, -1, 0, 0))
        if shape is None:
            return
        rows, columns = shape
        painter.setPen(TEXT)
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for row, text in self.row_labels:
            y = area.top() + (row + 0.5) / rows * area.height()
            painter.drawText(QRectF(0, y - line / 2, area.left() - 4, line), right, f"layer {text}")
        for column, text in self.column_labels:
            x = area.left() + (column + 0.5) / columns * area.width()
            painter.drawText(
                QRectF(x - 20, area.bottom() + 2, 40, line), Qt.AlignmentFlag.AlignHCenter, text
            )
        painter.drawText(
            QRectF(area.left(), area.bottom() + line + 2, area.width(), line),
            Qt.AlignmentFlag.AlignHCenter,
            "head",
        )


class HeadOverview(QWidget):
    """The layer x head image with its measure choice and a caption saying what it shows.

    The panel that holds it decides when to draw (`redraw` each frame it redraws; the
    overview draws only when due) and listens to `changed` (a new measure or size: draw at
    once) and `picked` (a cell clicked: its layer and head).
    """

    changed = Signal()
    picked = Signal(int, int)

    def __init__(self, state: InternalsState, lut: np.ndarray) -> None:
        super().__init__()
        self._state = state
        self._key: tuple[object, ...] = ()  # what the ticks and range were set for
        self.throttle = Throttle()
        self.layers: tuple[int, ...] = ()  # the image's rows, as last drawn
        self.measure_choice = QComboBox()
        self.measure_choice.addItems(list(MEASURES))
        self.measure_choice.currentIndexChanged.connect(lambda _index: self.changed.emit())
        self.plot = OverviewGrid(lut)
        self.plot.setMinimumHeight(90)
        self.plot.clicked.connect(self._on_click)
        self.plot.resized.connect(self._on_resized)
        self.caption = QLabel("")
        self.caption.setWordWrap(True)
        measure_row = QHBoxLayout()
        measure_row.addWidget(QLabel("Every watched layer × head, coloured by"))
        measure_row.addWidget(self.measure_choice)
        measure_row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(measure_row)
        layout.addWidget(self.plot, 1)
        layout.addWidget(ReadoutBox(self.caption))

    def _on_resized(self) -> None:
        if self._key:  # the labels that fit may have changed
            self.changed.emit()

    def wants_drawing(self) -> bool:
        """New statistics arrived since it was drawn, and it is due."""
        return self.throttle.pending and self.due()

    def redraw(self) -> None:
        """Draw if due; otherwise keep the new statistics pending for a later frame."""
        self.throttle.pending = True
        if self.due():
            self.draw()
            self.throttle.drawn(self._shape())

    def _shape(self) -> tuple[object, ...]:
        """What, changed, redraws the overview at once: its layers, measure and size."""
        size = self.plot.size()
        measure = self.measure_choice.currentText()
        return (tuple(sorted(self._state.head_stats)), measure, size.width(), size.height())

    def due(self) -> bool:
        if self._state.stats_pending:  # a prompt's rows are still being summed, a piece a tick
            return False
        # while a teacher steps, every step shows at once
        return self._state.explaining or self.throttle.due(OVERVIEW_INTERVAL_S, self._shape())

    def draw(self) -> None:
        stats = self._state.head_stats
        measure = MEASURES[self.measure_choice.currentText()]
        self.layers = layers = tuple(sorted(stats))
        if not layers:
            self.plot.clear()
            self.caption.setText("")
            self._key = ()
            return
        heads = max(s.heads for s in stats.values())
        grid = np.zeros((len(layers), heads), dtype=np.float32)
        for row, layer in enumerate(layers):
            values = stats[layer].mean(measure)
            grid[row, : values.size] = values
        low, high = float(grid.min()), float(grid.max())
        high = max(high, low + 1e-6)  # spread the colours over the values present
        self.plot.set_image(grid, (low, high))
        self.caption.setText(
            f"Colour: {self.measure_choice.currentText()} per head over this reply's rows, "
            f"{MEANINGS[measure]}. Dark {low:.3g}, bright {high:.3g}. Click a cell to open "
            "that head."
        )
        self._set_ticks(layers, heads)

    def _set_ticks(self, layers: tuple[int, ...], heads: int) -> None:
        """Label every head (layer) when there is room, every other (or fewer) when narrow:
        labels drawn on top of each other read as none."""
        box = self.plot.plot_rect()
        line = self.fontMetrics().height()
        head_step = label_step(heads, box.width(), self.fontMetrics().horizontalAdvance("00 "))
        layer_step = label_step(len(layers), box.height(), line)
        key = (layers, heads, head_step, layer_step)
        if key == self._key:  # labels change with the shape only
            return
        self._key = key
        rows = [(i, str(layers[i])) for i in range(0, len(layers), layer_step)]
        self.plot.set_labels(rows, [(h, str(h)) for h in range(0, heads, head_step)])

    def cell(self, position: QPointF) -> tuple[int, int] | None:
        """The (layer, head) under a point of the grid widget (`plot`), if any."""
        cell = self.plot.cell_at(position)
        return None if cell is None else (self.layers[cell[0]], cell[1])

    def _on_click(self, row: int, head: int) -> None:
        if row < len(self.layers):
            self.picked.emit(self.layers[row], head)
