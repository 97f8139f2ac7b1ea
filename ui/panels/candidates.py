"""The next-token candidates as a painted bar chart: one row per candidate, two bars each.

The chart changes with every token while a reply streams. As a pyqtgraph plot, each change
set two bar items and the tick labels of an axis, which re-measured every label and repainted
the plot through its scene, costly every frame. Painted directly it is one widget update of a
few rectangles and lines of text, far cheaper, and nothing is laid out again.
"""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFontMetrics, QPainter, QPaintEvent
from PySide6.QtWidgets import QSizePolicy, QWidget

BACKGROUND = QColor(0, 0, 0)
TEXT = QColor(150, 150, 150)
TITLE = QColor(200, 200, 200)
GRID = QColor(70, 70, 70)
BAR_SHARE = 0.38  # each of a row's two bars is this share of the row's height
TICKS = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True)
class CandidateRow:
    """One candidate as the chart draws it."""

    label: str
    prob: float
    sampled_prob: float
    chosen: bool


class CandidateChart(QWidget):
    """Rows of (label, probability bar, after-sampling bar); the chosen token's in other colours.

    `colours` is (probability, after sampling, chosen probability, chosen after sampling).
    """

    def __init__(
        self,
        title: str,
        axis_label: str,
        label_width: int,
        colours: tuple[tuple[int, int, int], ...],
        parent: QWidget | None = None,
    ) -> None:
        super().__init__(parent)
        self.title = title
        self.axis_label = axis_label
        self.label_width = label_width  # fixed: new labels never move the bars
        self._colours = [QColor(*c) for c in colours]
        self.rows: tuple[CandidateRow, ...] = ()
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def set_rows(self, rows: tuple[CandidateRow, ...]) -> None:
        if rows != self.rows:
            self.rows = rows
            self.update()

    def row_height(self) -> int:
        """A row is at least a line of text high, so labels never overlap."""
        return QFontMetrics(self.font()).height() + 2

    def minimum_height_for(self, count: int) -> int:
        line = QFontMetrics(self.font()).height()
        return max(count, 3) * self.row_height() + 3 * line + 16

    def plot_rect(self) -> QRectF:
        """Where the bars go: right of the labels, under the title, over the x axis."""
        line = QFontMetrics(self.font()).height()
        left = self.label_width + 8
        top = line + 8
        bottom = self.height() - 2 * line - 10
        return QRectF(left, top, max(self.width() - left - 16, 1), max(bottom - top, 1))

    def bar_rects(self, index: int) -> tuple[QRectF, QRectF]:
        """The (probability, after sampling) bars of row `index`, in widget pixels."""
        area = self.plot_rect()
        row = area.height() / max(len(self.rows), 1)
        centre = area.top() + (index + 0.5) * row
        height = row * BAR_SHARE
        candidate = self.rows[index]
        prob = QRectF(area.left(), centre - height, area.width() * candidate.prob, height)
        sampled = QRectF(area.left(), centre, area.width() * candidate.sampled_prob, height)
        return prob, sampled

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), BACKGROUND)
        metrics = painter.fontMetrics()
        line = metrics.height()
        area = self.plot_rect()
        painter.setPen(TITLE)
        painter.drawText(
            QRectF(0, 2, self.width(), line + 4), Qt.AlignmentFlag.AlignCenter, self.title
        )
        self._draw_x_axis(painter, area, line)
        row = area.height() / max(len(self.rows), 1)
        prob_colour, sampled_colour, chosen_prob, chosen_sampled = self._colours
        for index, candidate in enumerate(self.rows):
            prob, sampled = self.bar_rects(index)
            painter.fillRect(prob, chosen_prob if candidate.chosen else prob_colour)
            painter.fillRect(sampled, chosen_sampled if candidate.chosen else sampled_colour)
            painter.setPen(TEXT)
            label = QRectF(0, area.top() + index * row, self.label_width, row)
            align = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
            painter.drawText(label, align, candidate.label)
        painter.end()

    def _draw_x_axis(self, painter: QPainter, area: QRectF, line: int) -> None:
        painter.setPen(GRID)
        painter.drawLine(area.bottomLeft(), area.bottomRight())
        painter.drawLine(area.topLeft(), area.bottomLeft())
        for tick in TICKS:
            x = area.left() + tick * area.width()
            painter.setPen(GRID)
            painter.drawLine(int(x), int(area.bottom()), int(x), int(area.bottom()) + 4)
            painter.setPen(TEXT)
            text = QRectF(x - 30, area.bottom() + 5, 60, line)
            painter.drawText(text, Qt.AlignmentFlag.AlignHCenter, f"{tick:.1f}")
        caption = QRectF(area.left(), area.bottom() + line + 6, area.width(), line + 2)
        painter.drawText(caption, Qt.AlignmentFlag.AlignHCenter, self.axis_label)
