"""A painted line chart for series that grow every token (the decode-step latency).

As a pyqtgraph plot, each new point set the curve's data, re-measured its bounds and repainted
the plot through its scene, axes and legend included: costly every frame even for one curve.
Painted directly it is one widget update: a polyline per series, a few tick labels, and
a legend in its own row above the plot, where it never covers the data.

Ranges are set by the caller (ranges.AxisLimit: when the data outgrows them), so a frame that
only adds points moves no axis.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyqtgraph as pg
from numpy.typing import ArrayLike
from PySide6.QtCore import QLineF, QPointF, QRectF, Qt
from PySide6.QtGui import (
    QColor,
    QFontMetrics,
    QPainter,
    QPainterPath,
    QPaintEvent,
    QPen,
    QPixmap,
)
from PySide6.QtWidgets import QSizePolicy, QWidget

BACKGROUND = QColor(0, 0, 0)
TEXT = QColor(150, 150, 150)
TITLE = QColor(200, 200, 200)
GRID = QColor(70, 70, 70)
TICKS = 5  # about this many labelled ticks per axis
LEGEND_SAMPLE = 24  # pixels of line drawn before a legend name


@dataclass
class Series:
    """One curve: its points, pen and name. `getData`/`setData`/`isVisible`/`setVisible`
    read and write it as a pyqtgraph curve's (the panels' tests read curves that way)."""

    colour: tuple[int, int, int]
    width: float = 1.0  # 2 pixels take twice as long to stroke
    dashed: bool = False
    name: str = ""
    step: bool = False  # each value holds until the next x (the last one for one x more)
    fill: tuple[int, int, int, int] | None = None  # the area down to 0, in this RGBA
    x: np.ndarray = field(default_factory=lambda: np.zeros(0))
    y: np.ndarray = field(default_factory=lambda: np.zeros(0))
    visible: bool = True
    chart: LineChart | None = None

    def setData(self, x: ArrayLike, y: ArrayLike) -> None:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        if x.shape != self.x.shape or not (np.array_equal(x, self.x) and np.array_equal(y, self.y)):
            self.x, self.y = x, y
            self._changed()

    def getData(self) -> tuple[np.ndarray, np.ndarray]:
        return self.x, self.y

    def setVisible(self, visible: bool) -> None:
        if visible != self.visible:
            self.visible = visible
            self._changed()

    def isVisible(self) -> bool:
        return self.visible

    def pen(self) -> QPen:
        pen = QPen(QColor(*self.colour), self.width)
        if self.dashed:
            pen.setStyle(Qt.PenStyle.DashLine)
        return pen

    def _changed(self) -> None:
        if self.chart is not None:
            self.chart.update()


def nice_ticks(limit: float, count: int = TICKS, whole: bool = False) -> np.ndarray:
    """Ticks from 0 to at most `limit` at a step of 1, 2 or 5 times a power of ten; `whole`:
    a step of 1 at least (an axis of counts has no token 0.5)."""
    if limit <= 0 or not math.isfinite(limit):
        return np.zeros(1)
    raw = max(limit / count, 1.0) if whole else limit / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return np.arange(0, limit + step * 1e-9, step)


def tick_text(value: float, step: float) -> str:
    """A tick's label with as many decimals as its step needs."""
    decimals = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{value:.{decimals}f}"


MARKER = QColor(255, 200, 40)  # the selected step


class KeptFrame:
    """A painted chart's pixels that change seldom (its background, title, axes and labels),
    drawn again only when what they show changes: a frame that adds data copies them instead
    of drawing ~20 labels again (half of a paint)."""

    def __init__(self) -> None:
        self.pixmap: QPixmap | None = None
        self.key: tuple[object, ...] = ()
        self.drawn = 0  # how often it was drawn (the tests read it)

    def get(
        self, widget: QWidget, key: tuple[object, ...], draw: Callable[[QPainter], None]
    ) -> QPixmap:
        """The frame for `key` (with the widget's size, pixel ratio and font), `draw`n on the
        background if it changed."""
        key = (widget.size(), widget.devicePixelRatioF(), widget.font(), *key)
        if key != self.key or self.pixmap is None:
            ratio = widget.devicePixelRatioF()
            pixmap = QPixmap(widget.size() * ratio)
            pixmap.setDevicePixelRatio(ratio)
            painter = QPainter(pixmap)
            painter.setFont(widget.font())
            painter.fillRect(widget.rect(), BACKGROUND)
            draw(painter)
            painter.end()
            self.pixmap, self.key = pixmap, key
            self.drawn += 1
        return self.pixmap


class LineChart(QWidget):
    """Series on shared axes from 0 to `x_limit` and 0 to `y_limit`, painted on a black plot;
    the first series added is drawn on top and named first in the legend.

    """

    def __init__(
        self,
        title: str,
        x_label: str,
        y_label: str,
        y_units: Sequence[tuple[float, str]] = ((1.0, ""),),
        parent: QWidget | None = None,
        x_counts: bool = True,
    ) -> None:
        """`y_units`: (size, name) pairs, smallest first; the y labels use the largest unit
        the range reaches (e.g. ((1e-3, "ms"), (1, "s")) or bytes in B, KiB, MiB). `x_counts`:
        x counts something (tokens, steps), so its ticks are whole numbers."""
        super().__init__(parent)
        self.x_counts = x_counts
        self.title = title
        self.x_label, self.y_label, self.y_units = x_label, y_label, tuple(y_units)
        self.series: list[Series] = []
        self.x_limit, self.y_limit = 1.0, 1.0
        self.range_changes = 0  # how often a range moved (a test reads it)
        self._frame = KeptFrame()  # the background, title, axes and legend
        self.marker: float | None = None  # the selected step's x, drawn as a vertical line
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def set_marker(self, x: float | None) -> None:
        """Mark the selected step at `x` (None: no mark)."""
        if x != self.marker:
            self.marker = x
            self.update()

    def add_series(self, series: Series) -> Series:
        series.chart = self
        self.series.append(series)
        self.update()
        return series

    def set_range(self, x_limit: float | None = None, y_limit: float | None = None) -> None:
        x_limit = self.x_limit if x_limit is None else x_limit
        y_limit = self.y_limit if y_limit is None else y_limit
        if (x_limit, y_limit) != (self.x_limit, self.y_limit):
            self.x_limit, self.y_limit = x_limit, y_limit
            self.range_changes += 1
            self.update()

    def y_unit(self) -> tuple[float, str]:
        """The unit the y labels are in: the largest one the range reaches."""
        fitting = [unit for unit in self.y_units if unit[0] <= self.y_limit]
        return fitting[-1] if fitting else self.y_units[0]

    def y_title(self) -> str:
        unit = self.y_unit()[1]
        return f"{self.y_label} ({unit})" if unit else self.y_label

    def view_range(self) -> tuple[tuple[float, float], tuple[float, float]]:
        return (0.0, self.x_limit), (0.0, self.y_limit)

    def legend_names(self) -> list[str]:
        """The legend's entries: the named series shown."""
        return [s.name for s in self.series if s.visible and s.name]

    # -- geometry ----------------------------------------------------------------------------

    def plot_rect(self) -> QRectF:
        """The data area: right of the y labels, under the title and legend, over the x axis."""
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        left = metrics.horizontalAdvance("0000.0") + 10  # the tick labels
        top = 2 * line + 10  # the title, then the legend's row
        bottom = self.height() - 2 * line - 8
        return QRectF(left, top, max(self.width() - left - 12, 1), max(bottom - top, 1))

    def point_at(self, x: float, y: float) -> QPointF:
        """Where the data point (x, y) is drawn, in widget pixels."""
        area = self.plot_rect()
        return QPointF(
            area.left() + x / self.x_limit * area.width(),
            area.bottom() - y / self.y_limit * area.height(),
        )

    def legend_rect(self) -> QRectF:
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        return QRectF(0, line + 4, self.width(), line + 4)

    # -- painting ----------------------------------------------------------------------------

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.drawPixmap(0, 0, self._frame_pixmap())
        area = self.plot_rect()
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setClipRect(area.adjusted(-2, -2, 2, 2))
        for series in reversed(self.series):  # the first series on top
            if series.visible and series.x.size:
                path = self._path(series, area)
                if series.fill is not None:
                    self._fill_under(painter, path, series, area)
                painter.setPen(series.pen())
                painter.drawPath(path)
        if self.marker is not None and self.x_limit > 0:
            x = area.left() + self.marker / self.x_limit * area.width()
            painter.setPen(QPen(MARKER, 2))
            painter.drawLine(QPointF(x, area.top()), QPointF(x, area.bottom()))
        painter.end()

    @property
    def frames_drawn(self) -> int:
        """How often the axes, title and legend were drawn (a test reads it)."""
        return self._frame.drawn

    def _frame_pixmap(self) -> QPixmap:
        """Everything but the curves, drawn again only when the size, a range or the legend
        changes."""
        legend = tuple((s.name, s.colour, s.dashed, s.width) for s in self.series if s.visible)
        return self._frame.get(
            self, (self.x_limit, self.y_limit, self.title, legend), self._draw_frame
        )

    def _draw_frame(self, painter: QPainter) -> None:
        line = painter.fontMetrics().height()
        painter.setPen(TITLE)
        painter.drawText(
            QRectF(0, 2, self.width(), line + 2), Qt.AlignmentFlag.AlignCenter, self.title
        )
        self._draw_axes(painter, self.plot_rect(), line)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)  # the legend's samples
        self._draw_legend(painter)

    def _fill_under(
        self, painter: QPainter, path: QPainterPath, series: Series, area: QRectF
    ) -> None:
        assert series.fill is not None
        area_path = QPainterPath(path)
        area_path.lineTo(path.currentPosition().x(), area.bottom())
        area_path.lineTo(path.elementAt(0).x, area.bottom())
        area_path.closeSubpath()
        painter.fillPath(area_path, QColor(*series.fill))

    def _path(self, series: Series, area: QRectF) -> QPainterPath:
        x, y = series.x, series.y
        if series.step:  # (x0, y0) (x1, y0) (x1, y1) ... (x_last + 1, y_last)
            x = np.append(np.repeat(x, 2)[1:], x[-1] + 1)
            y = np.repeat(y, 2)
        xs = area.left() + x / self.x_limit * area.width()
        ys = area.bottom() - y / self.y_limit * area.height()
        path: QPainterPath = pg.arrayToQPath(xs, ys)  # from the arrays at once, not by point
        return path

    def _draw_axes(self, painter: QPainter, area: QRectF, line: int) -> None:
        painter.setPen(GRID)
        painter.drawLine(area.bottomLeft(), area.bottomRight())
        painter.drawLine(area.topLeft(), area.bottomLeft())
        # No more ticks than their labels have room for (a short plot crowded them).
        x_count = max(1, min(TICKS, int(area.width() / 70)))
        x_ticks = nice_ticks(self.x_limit, x_count, whole=self.x_counts)
        x_step = float(x_ticks[1] - x_ticks[0]) if x_ticks.size > 1 else 1.0
        for tick in x_ticks.tolist():
            x = area.left() + tick / self.x_limit * area.width()
            painter.setPen(GRID)
            painter.drawLine(QLineF(x, area.bottom(), x, area.bottom() + 4))
            painter.setPen(TEXT)
            label = QRectF(x - 40, area.bottom() + 5, 80, line)
            painter.drawText(label, Qt.AlignmentFlag.AlignHCenter, tick_text(tick, x_step))
        caption = QRectF(area.left(), area.bottom() + line + 6, area.width(), line + 2)
        painter.drawText(caption, Qt.AlignmentFlag.AlignHCenter, self.x_label)
        scaled = self.y_limit / self.y_unit()[0]
        y_ticks = nice_ticks(scaled, max(1, min(TICKS, int(area.height() / (1.5 * line)))))
        y_step = float(y_ticks[1] - y_ticks[0]) if y_ticks.size > 1 else 1.0
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for tick in y_ticks.tolist():
            y = area.bottom() - tick / scaled * area.height() if scaled else area.bottom()
            painter.setPen(GRID)
            painter.drawLine(QLineF(area.left() - 4, y, area.left(), y))
            painter.drawLine(QLineF(area.left(), y, area.right(), y))  # a faint grid line
            painter.setPen(TEXT)
            painter.drawText(QRectF(0, y - line / 2, area.left() - 6, line), right,
                             tick_text(tick, y_step))  # fmt: skip
        # The y axis's name over its labels, in the legend's row: written up the side, it
        # was cut off in a short plot.
        painter.drawText(self.legend_rect().adjusted(4, 0, 0, 0), Qt.AlignmentFlag.AlignLeft
                         | Qt.AlignmentFlag.AlignVCenter, self.y_title())  # fmt: skip

    def _draw_legend(self, painter: QPainter) -> None:
        """The shown series' names in one row above the plot, right-aligned."""
        shown = [s for s in self.series if s.visible and s.name]
        if not shown:
            return
        metrics = painter.fontMetrics()
        row = self.legend_rect()
        widths = [LEGEND_SAMPLE + 6 + metrics.horizontalAdvance(s.name) + 14 for s in shown]
        named = metrics.horizontalAdvance(self.y_title()) + 16  # the y axis's name, left
        x = max(row.right() - sum(widths) - 4, named)
        middle = row.center().y()
        for series, width in zip(shown, widths, strict=True):
            painter.setPen(series.pen())
            painter.drawLine(QLineF(x, middle, x + LEGEND_SAMPLE, middle))
            painter.setPen(TEXT)
            text = QRectF(x + LEGEND_SAMPLE + 6, row.top(), width, row.height())
            painter.drawText(text, Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter,
                             series.name)  # fmt: skip
            x += width
