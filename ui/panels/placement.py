"""Placement panel: where the layers live, and what each decode step spent moving weights.

A strip of the decoder layers coloured by place (GPU, RAM, disk) with the bytes on each; under
it the latest reply's decode steps as stacked bars, weight transfer (measured around the hooks'
weight loading) under compute (the rest of the step), with the load's predictions as ticks on
each (of the transfer, and of the whole step); one sentence says what bounds the latest step.
Painted directly, as the next-token chart is: one widget update a frame, nothing laid out
again.
"""

from __future__ import annotations

import numpy as np
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.device_map import format_bytes
from engine.events import Placement
from ui.panels.empty import EmptyState
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import StatePanel
from ui.panels.state import PLACEMENT, InternalsState
from ui.panels.state.placement import PREDICTED_S, PREDICTED_STEP_S, STEP_S, TRANSFER_S

BACKGROUND, TEXT, GRID = QColor(0, 0, 0), QColor(170, 170, 170), QColor(70, 70, 70)
# a step's compute, its weights read in, the read predicted from the measured bandwidth, and
# the whole step predicted (that read plus the compute measured at load)
COMPUTE, TRANSFER, PREDICTED = QColor(66, 133, 244), QColor(251, 140, 0), QColor(255, 255, 255)
PREDICTED_STEP = QColor(190, 120, 255)
GPU = QColor(52, 168, 83)
PLACE_COLOURS = {"cpu": COMPUTE, "disk": TRANSFER}
PLACE_NAMES = {"cpu": "RAM", "disk": "disk"}
STEPS_SHOWN = 96  # the latest steps, one bar each

EMPTY_MESSAGE = (
    "<b>Placement</b><br>Where the model's layers live (GPU, RAM or disk) and, for a model "
    "bigger than memory, what every decode step spends reading weights in before it can "
    "compute, measured, beside the prediction.<br><br><i>Send a message to a model loaded "
    "with a placement (Load model… → Placement, or --max-memory cpu=250MiB).</i>"
)


def place_colour(place: str) -> QColor:
    """RAM blue, disk orange, GPUs green: each further GPU a darker green."""
    if place in PLACE_COLOURS:
        return PLACE_COLOURS[place]
    return GPU.darker(100 + 45 * _gpu_index(place))


def place_name(place: str) -> str:
    return PLACE_NAMES.get(place) or f"GPU {_gpu_index(place)}"


def _gpu_index(place: str) -> int:
    return int(place.partition(":")[2] or 0)


def _moves(placement: Placement) -> str:
    """What a step reads in, as the strip's legend says it."""
    if not placement.moved_bytes:
        return "each step reads in nothing"
    if placement.mapped:  # Glassbox's own model: its disk is the mapped file
        return "disk is the mapped file: a step reads what the page cache lacks"
    return f"each step reads in {format_bytes(placement.moved_bytes)}"


class PlacementChart(QWidget):
    """The layer strip and the per-step bars, painted."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.placement: Placement | None = None
        self.steps = np.zeros((0, 5))
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumHeight(160)

    def set_data(self, placement: Placement | None, steps: np.ndarray) -> None:
        self.placement, self.steps = placement, steps[-STEPS_SHOWN:]
        self.update()

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), BACKGROUND)
        line = painter.fontMetrics().height()
        if self.placement is not None:
            strip_bottom = self._draw_strip(painter, self.placement, line)
            self._draw_steps(painter, QRectF(8, strip_bottom + 8, self.width() - 16, 0), line)
        painter.end()

    def _draw_strip(self, painter: QPainter, placement: Placement, line: int) -> float:
        painter.setPen(TEXT)
        title = f"{len(placement.layer_places)} layers, computed on {placement.execution_device}"
        painter.drawText(QRectF(8, 2, self.width() - 16, line + 2), title)
        top, height = line + 6, max(line, 14)
        count = max(len(placement.layer_places), 1)
        width = (self.width() - 16) / count
        for index, place in enumerate(placement.layer_places):
            cell = QRectF(8 + index * width, top, max(width - 1, 1), height)
            painter.fillRect(cell, place_colour(place))
        x, y = 8.0, top + height + 4
        metrics = painter.fontMetrics()
        for place, size in placement.place_bytes:  # a swatch of the strip's colour, then words
            painter.fillRect(QRectF(x, y + 3, line - 6, line - 6), place_colour(place))
            text = f"{place_name(place)} {format_bytes(size)}"
            advance = metrics.horizontalAdvance(text)
            painter.drawText(QRectF(x + line - 2, y, advance + 4, line), text)
            x += line + advance + 16
        painter.drawText(QRectF(x, y, max(self.width() - x - 8, 1), line), _moves(placement))
        return y + line + 4

    def _draw_steps(self, painter: QPainter, area: QRectF, line: int) -> None:
        area.setBottom(self.height() - line - 8)
        steps = self.steps
        if not len(steps) or area.height() < 10:
            return
        top = float(max(steps[:, [STEP_S, PREDICTED_S, PREDICTED_STEP_S]].max(), 1e-9))
        width = area.width() / STEPS_SHOWN
        scale = area.height() / top
        for index, (step, transfer, predicted, predicted_step) in enumerate(
            steps[:, [STEP_S, TRANSFER_S, PREDICTED_S, PREDICTED_STEP_S]]
        ):
            left = area.left() + index * width
            moved = min(transfer, step) * scale
            painter.fillRect(QRectF(left, area.bottom() - moved, width * 0.8, moved), TRANSFER)
            rest = max(step - transfer, 0) * scale
            bar = QRectF(left, area.bottom() - moved - rest, width * 0.8, rest)
            painter.fillRect(bar, COMPUTE)
            for value, colour in ((predicted, PREDICTED), (predicted_step, PREDICTED_STEP)):
                painter.setPen(QPen(colour, 2))
                y = area.bottom() - value * scale
                painter.drawLine(int(left), int(y), int(left + width * 0.8), int(y))
        painter.setPen(GRID)
        painter.drawLine(area.bottomLeft(), area.bottomRight())
        painter.setPen(TEXT)
        caption = (
            f"decode steps (tallest {top * 1000:.0f} ms): orange reading weights in,"
            " blue computing; ticks: white the predicted read, violet the predicted step"
        )
        painter.drawText(QRectF(area.left(), area.bottom() + 2, area.width(), line + 2), caption)


class PlacementPanel(StatePanel):
    """The chart and the sentence of what bounds the latest step."""

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, PLACEMENT, parent)
        self.chart = PlacementChart()
        self.sentence = QLabel()
        self.sentence.setWordWrap(True)
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.chart, 1)
        layout.addWidget(ReadoutBox(self.sentence))
        self.pages = EmptyState(EMPTY_MESSAGE, content)
        outer = QVBoxLayout(self)
        outer.setContentsMargins(0, 0, 0, 0)
        outer.addWidget(self.pages)

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        trace = self._state.placement
        text = trace.sentence()
        # A model wholly in place has nothing to draw: the message says so, and how to place one
        self.pages.show_content(trace.placement is not None)
        self.pages.set_message(EMPTY_MESSAGE + (f"<br><br>{text}" if text else ""))
        if trace.placement is not None:
            self.chart.set_data(trace.placement, trace.steps.view())
            if text != self.sentence.text():
                self.sentence.setText(text)
        self.tracker.drawn(revisions)
