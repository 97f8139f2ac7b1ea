"""The roofline's log-log chart, painted: its axes, grid and roof kept in a pixmap, its points
drawn over them from one small picture per kind of symbol.

As a pyqtgraph plot, each redraw of the decode cloud set a scatter's data (its bounds measured,
its spatial index rebuilt) and repainted the plot through its scene, axes and lines: a few
milliseconds a reply for a chart that changes by a hair. Painted, a redraw copies the kept
frame and stamps each point's symbol; the frame (title, decades, grid, the roof's lines) is
drawn again only when the range, the peaks or the widget's size change.

Items keep what they were given in data units (`xData`, `yData`, as pyqtgraph's items kept
them); `getData` gives the base-10 logarithms of the points the chart can place (a log axis
has no place for zero or less), as a pyqtgraph item on log axes did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from PySide6.QtCore import QLineF, QPointF, QRectF, Qt
from PySide6.QtGui import (
    QColor,
    QFontMetrics,
    QPainter,
    QPainterPath,
    QPen,
    QPixmap,
    QPolygonF,
)
from PySide6.QtWidgets import QWidget

from ui.panels.bar_chart import PaintedChart
from ui.panels.line_chart import GRID, TEXT

HOVER_PIXELS = 8  # a point this close to the pointer is the one its tooltip names


def si(value: float, unit: str) -> str:
    """1.23e12, "FLOP/s" -> "1.23 TFLOP/s"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def symbol_path(shape: str, size: float) -> QPainterPath:
    """A symbol `size` pixels across, centred on (0, 0): "o" circle, "d" diamond, "t" triangle
    (pointing down), "s" square."""
    half = size / 2
    path = QPainterPath()
    if shape == "o":
        path.addEllipse(QPointF(0, 0), half, half)
    elif shape == "s":
        path.addRect(QRectF(-half, -half, size, size))
    else:
        corners = {
            "d": [(0, -half), (half, 0), (0, half), (-half, 0)],
            "t": [(-half, -half), (half, -half), (0, half)],
        }[shape]
        path.addPolygon(QPolygonF([QPointF(x, y) for x, y in corners]))
        path.closeSubpath()
    return path


@dataclass(eq=False)
class LogItem:
    """Points (or, with `line`, a polyline) of the chart, in data units."""

    name: str
    brush: tuple[int, ...] = (255, 255, 255)
    shape: str = "o"
    size: float = 5.0
    outlined: bool = False  # a white edge, as the latest step's and the prefills' symbols
    line: QPen | None = None  # a line through the points instead of symbols
    xData: np.ndarray = field(default_factory=lambda: np.zeros(0))
    yData: np.ndarray = field(default_factory=lambda: np.zeros(0))
    chart: RooflineChart | None = None
    _stamp: QPixmap | None = field(default=None, init=False, repr=False)

    def set_points(self, x: ArrayLike, y: ArrayLike) -> None:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        same = x.shape == self.xData.shape and y.shape == self.yData.shape
        if same and np.array_equal(x, self.xData) and np.array_equal(y, self.yData):
            return
        self.xData, self.yData = x, y
        if self.chart is not None:
            self.chart.update()  # a line's change reaches the kept frame through frame_key

    setData = set_points

    def getData(self) -> tuple[np.ndarray, np.ndarray]:
        """The base-10 logarithms of the points a log axis can place."""
        x, y = self.xData, self.yData
        placed = (x > 0) & (y > 0) & np.isfinite(x) & np.isfinite(y)
        return np.log10(x[placed]), np.log10(y[placed])

    def stamp(self, ratio: float) -> QPixmap:
        """The symbol drawn once, at the screen's pixel ratio; each point copies it."""
        if self._stamp is None or self._stamp.devicePixelRatio() != ratio:
            side = math.ceil(self.size + 3)
            pixmap = QPixmap(round(side * ratio), round(side * ratio))
            pixmap.setDevicePixelRatio(ratio)
            pixmap.fill(Qt.GlobalColor.transparent)
            painter = QPainter(pixmap)
            painter.setRenderHint(QPainter.RenderHint.Antialiasing)
            painter.translate(side / 2, side / 2)
            painter.setPen(QPen(QColor(255, 255, 255), 1) if self.outlined else Qt.PenStyle.NoPen)
            painter.setBrush(QColor(*self.brush))
            painter.drawPath(symbol_path(self.shape, self.size))
            painter.end()
            self._stamp = pixmap
        return self._stamp


class RooflineChart(PaintedChart):
    """Log-log axes over whole decades: `lines` are drawn with the axes in the kept frame (the
    roof changes with the peaks and the range), `points` over it at every paint, the first
    added lowest."""

    def __init__(
        self, title: str, x_label: str, y_label: str, parent: QWidget | None = None
    ) -> None:
        super().__init__(title, parent)
        self.x_label, self.y_label = x_label, y_label
        self.decades = ((0, 1), (0, 1))  # (low, high) powers of ten on x, then on y
        self.lines: list[LogItem] = []
        self.points: list[LogItem] = []

    def add_line(self, name: str, pen: QPen) -> LogItem:
        item = LogItem(name, line=pen, chart=self)
        self.lines.append(item)
        return item

    def add_points(
        self, name: str, shape: str, size: float, brush: tuple[int, ...], outlined: bool = False
    ) -> LogItem:
        item = LogItem(name, brush, shape, size, outlined, chart=self)
        self.points.append(item)
        return item

    def set_decades(self, x: tuple[int, int], y: tuple[int, int]) -> None:
        if (x, y) != self.decades:
            self.decades = (x, y)
            self.update()

    def view_range(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """The shown range in log10 units (x, then y)."""
        (x_low, x_high), (y_low, y_high) = self.decades
        return (float(x_low), float(x_high)), (float(y_low), float(y_high))

    # -- geometry ----------------------------------------------------------------------------

    def plot_rect(self) -> QRectF:
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        low, high = self.decades[1]
        widest = max(metrics.horizontalAdvance(self.tick_label(p)) for p in range(low, high + 1))
        left = line + 8 + widest + 8  # the axis's name written upwards, then the labels
        top = line + 10
        bottom = self.height() - 2 * line - 10
        return QRectF(left, top, max(self.width() - left - 12, 1), max(bottom - top, 1))

    def pixels(self, x: np.ndarray, y: np.ndarray, area: QRectF) -> tuple[np.ndarray, np.ndarray]:
        """Widget pixels of log10 positions."""
        (x_low, x_high), (y_low, y_high) = self.view_range()
        xs = area.left() + (x - x_low) / (x_high - x_low) * area.width()
        ys = area.bottom() - (y - y_low) / (y_high - y_low) * area.height()
        return xs, ys

    def point_at(self, x: float, y: float) -> QPointF:
        """Where the data point (x, y), in data units, is drawn, in widget pixels."""
        xs, ys = self.pixels(np.log10([x]), np.log10([y]), self.plot_rect())
        return QPointF(float(xs[0]), float(ys[0]))

    @staticmethod
    def tick_label(power: int) -> str:
        return si(10.0**power, "").strip()

    # -- painting ----------------------------------------------------------------------------

    def frame_key(self) -> tuple[object, ...]:
        lines = tuple((tuple(i.xData.tolist()), tuple(i.yData.tolist())) for i in self.lines)
        return (*super().frame_key(), self.decades, lines)

    def draw_frame(self, painter: QPainter, area: QRectF) -> None:
        line = self.line()
        (x_low, x_high), (y_low, y_high) = self.decades
        painter.setPen(GRID)
        painter.drawRect(area)
        xs, _ = self.pixels(np.arange(x_low, x_high + 1.0), np.zeros(x_high - x_low + 1), area)
        _, ys = self.pixels(np.zeros(y_high - y_low + 1), np.arange(y_low, y_high + 1.0), area)
        for power, x in zip(range(x_low, x_high + 1), xs.tolist(), strict=True):
            painter.setPen(GRID)
            painter.drawLine(QLineF(x, area.top(), x, area.bottom() + 4))
            painter.setPen(TEXT)
            text = QRectF(x - 40, area.bottom() + 5, 80, line)
            painter.drawText(text, Qt.AlignmentFlag.AlignHCenter, self.tick_label(power))
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for power, y in zip(range(y_low, y_high + 1), ys.tolist(), strict=True):
            painter.setPen(GRID)
            painter.drawLine(QLineF(area.left() - 4, y, area.right(), y))
            painter.setPen(TEXT)
            text = QRectF(line + 8, y - line / 2, area.left() - line - 14, line)
            painter.drawText(text, right, self.tick_label(power))
        caption = QRectF(area.left(), area.bottom() + line + 6, area.width(), line + 2)
        painter.drawText(caption, Qt.AlignmentFlag.AlignHCenter, self.x_label)
        painter.save()
        painter.translate(4, area.center().y())
        painter.rotate(-90)
        upwards = QRectF(-area.height() / 2, 0, area.height(), line + 2)
        painter.drawText(upwards, Qt.AlignmentFlag.AlignHCenter, self.y_label)
        painter.restore()
        painter.setClipRect(area)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        for item in self.lines:
            x, y = item.getData()
            if x.size > 1 and item.line is not None:
                xs, ys = self.pixels(x, y, area)
                painter.setPen(item.line)
                painter.drawPolyline(QPolygonF([QPointF(*p) for p in zip(xs, ys, strict=True)]))
        painter.setClipping(False)

    def draw_data(self, painter: QPainter, area: QRectF) -> None:
        ratio = self.devicePixelRatioF()
        for item in self.points:
            x, y = item.getData()
            if not x.size:
                continue
            stamp = item.stamp(ratio)
            half = stamp.width() / ratio / 2
            xs, ys = self.pixels(x, y, area)
            # At whole pixels: a copy at a fractional place costs Qt 2-4x as much (half a
            # pixel off at most, on a log axis).
            lefts = np.rint(xs - half).astype(int).tolist()
            tops = np.rint(ys - half).astype(int).tolist()
            for left, top in zip(lefts, tops, strict=True):
                painter.drawPixmap(left, top, stamp)

    def describe_at(self, point: QPointF) -> str:
        """The point nearest the pointer (within HOVER_PIXELS), topmost first: its kind and
        its numbers."""
        area = self.plot_rect()
        for item in reversed(self.points):
            x, y = item.getData()
            if not x.size:
                continue
            xs, ys = self.pixels(x, y, area)
            distance = np.hypot(xs - point.x(), ys - point.y())
            nearest = int(np.argmin(distance))
            if distance[nearest] <= HOVER_PIXELS:
                intensity, rate = 10.0 ** x[nearest], 10.0 ** y[nearest]
                return f"{item.name}: {intensity:.3g} FLOP/byte, {si(rate, 'FLOP/s')}"
        return ""
