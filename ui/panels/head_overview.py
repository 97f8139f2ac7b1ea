"""The attention panel's overview: every watched layer x head as one image, coloured by a mean
over the reply's rows (how much of a row its strongest key takes, or how evenly it spreads);
a click on a cell opens that head in the mosaic above it."""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from pyqtgraph.GraphicsScene.mouseEvents import MouseClickEvent
from PySide6.QtCore import QPointF, QRectF, Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QVBoxLayout, QWidget

from ui.panels.colour_image import ColourTableImage
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
        self.plot = pg.PlotWidget()
        self.plot.setMinimumHeight(90)
        self.image = ColourTableImage(axisOrder="row-major")
        self.image.setLookupTable(lut)
        self.caption = QLabel("")
        self.caption.setWordWrap(True)
        self._build_plot()
        measure_row = QHBoxLayout()
        measure_row.addWidget(QLabel("Every watched layer × head, coloured by"))
        measure_row.addWidget(self.measure_choice)
        measure_row.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(measure_row)
        layout.addWidget(self.plot, 1)
        layout.addWidget(ReadoutBox(self.caption))

    def _build_plot(self) -> None:
        plot = self.plot.getPlotItem()
        plot.setLabel("bottom", "head")
        plot.setLabel("left", "layer")
        plot.invertY(True)
        plot.setMouseEnabled(x=False, y=False)
        plot.disableAutoRange()
        plot.setMenuEnabled(False)
        plot.addItem(self.image)
        self.plot.scene().sigMouseClicked.connect(self._on_click)
        plot.vb.sigResized.connect(self._on_resized)

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
            self.image.clear()
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
        self.image.setImage(grid, levels=(low, high), autoLevels=False)
        self.caption.setText(
            f"Colour: {self.measure_choice.currentText()} per head over this reply's rows, "
            f"{MEANINGS[measure]}. Dark {low:.3g}, bright {high:.3g}. Click a cell to open "
            "that head."
        )
        self._set_ticks(layers, heads)

    def _set_ticks(self, layers: tuple[int, ...], heads: int) -> None:
        """Label every head (layer) when there is room, every other (or fewer) when narrow:
        labels drawn on top of each other read as none."""
        box = self.plot.getPlotItem().vb.size()
        line = self.fontMetrics().height()
        head_step = label_step(heads, box.width(), self.fontMetrics().horizontalAdvance("00 "))
        layer_step = label_step(len(layers), box.height(), line)
        key = (layers, heads, head_step, layer_step)
        if key == self._key:  # ticks and range change with the shape only
            return
        self._key = key
        plot = self.plot.getPlotItem()
        self.image.setRect(QRectF(0, 0, heads, len(layers)))
        plot.setRange(xRange=(0, heads), yRange=(0, len(layers)), padding=0)
        ticks = [(i + 0.5, str(layers[i])) for i in range(0, len(layers), layer_step)]
        plot.getAxis("left").setTicks([ticks])
        head_ticks = [(h + 0.5, str(h)) for h in range(0, heads, head_step)]
        plot.getAxis("bottom").setTicks([head_ticks])

    def _on_resized(self) -> None:
        if self._key:  # the labels that fit may have changed
            self.changed.emit()

    def cell(self, scene_position: QPointF) -> tuple[int, int] | None:
        """The (layer, head) under a scene position of the overview, if any."""
        view = self.plot.getPlotItem().vb
        if not self.layers or not view.sceneBoundingRect().contains(scene_position):
            return None
        point = view.mapSceneToView(scene_position)
        row, head = math.floor(point.y()), math.floor(point.x())
        if 0 <= row < len(self.layers) and 0 <= head < self.image.width():
            return self.layers[row], head
        return None

    def _on_click(self, event: MouseClickEvent) -> None:
        cell = self.cell(event.scenePos())
        if cell is not None:
            self.picked.emit(*cell)
