"""Painted bar charts of the Timing panel: the reply timeline and the prompt per turn.

As pyqtgraph plots, each new reply showed, a decode bar grown or a new chat's first reply
repainted them through their scenes, axes and text items: a few milliseconds a paint, several
paints a reply, on the GUI thread beside the model. Painted directly, like the step-latency
chart (line_chart.py), each keeps its axes, labels and title in a pixmap drawn again only when
its size, ranges or labels change; a paint then copies that pixmap and fills a few rectangles.

Bars are given as pyqtgraph's BarGraphItem named them (`BarSet.opts`: x0 / x, y / y0, width,
height), so a test reads what each bar spans.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import ArrayLike
from PySide6.QtCore import QEvent, QLineF, QPointF, QRectF, Qt
from PySide6.QtGui import (
    QColor,
    QFontMetrics,
    QHelpEvent,
    QMouseEvent,
    QPainter,
    QPaintEvent,
    QPen,
)
from PySide6.QtWidgets import QSizePolicy, QToolTip, QWidget

from ui.panels.line_chart import GRID, TEXT, TITLE, KeptFrame, nice_ticks, tick_text

BAR_SHARE = 0.6  # of a row's (or a turn's) slot that its bar fills
TICK_GAP = 70  # pixels a tick label needs along the x axis
SECONDS = ((1e-3, "ms"), (1.0, "s"))


def unit_for(limit: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    """The largest of `units` (size, name; smallest first) that `limit` reaches."""
    fitting = [unit for unit in units if unit[0] <= limit]
    return fitting[-1] if fitting else units[0]


@dataclass
class BarSet:
    """Bars of one colour. `opts` holds their arrays by pyqtgraph's names; `setOpts` replaces
    some of them and repaints the chart."""

    colour: tuple[int, int, int]
    opts: dict[str, np.ndarray] = field(default_factory=dict)
    chart: QWidget | None = None

    def setOpts(self, **arrays: ArrayLike) -> None:
        for name, values in arrays.items():
            self.opts[name] = np.asarray(values, dtype=np.float64)
        if self.chart is not None:
            self.chart.update()

    def spans(self) -> list[tuple[float, float, float]]:
        """(position, start, length) of each bar: the row or turn, then where it starts and
        how far it goes along the value axis."""
        opts = self.opts
        if "x0" in opts:  # horizontal: rows at y, from x0 for width
            columns = opts["y"], opts["x0"], opts["width"]
        else:  # vertical: columns at x, from y0 for height
            columns = opts["x"], opts["y0"], opts["height"]
        return list(zip(*(column.tolist() for column in columns), strict=True))


class PaintedChart(QWidget):
    """The shared part: a black plot area, its title, and a frame pixmap (everything but the
    data) kept while `frame_key` is unchanged (line_chart.KeptFrame)."""

    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = title
        self._frame = KeptFrame()
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def line(self) -> int:
        return QFontMetrics(self.font()).height()

    def frame_key(self) -> tuple[object, ...]:
        """What the frame shows besides the widget's size and font (KeptFrame adds those)."""
        return (self.title,)

    def draw_frame(self, painter: QPainter, area: QRectF) -> None:
        """Axes and labels around `area`, on the background (the title is drawn already)."""

    def plot_rect(self) -> QRectF:
        raise NotImplementedError

    def draw_data(self, painter: QPainter, area: QRectF) -> None:
        raise NotImplementedError

    def describe_at(self, point: QPointF) -> str:
        """The tooltip for a point of the widget ("" for none)."""
        return ""

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.drawPixmap(0, 0, self._frame.get(self, self.frame_key(), self._draw_frame))
        area = self.plot_rect()
        painter.setClipRect(area)
        self.draw_data(painter, area)
        painter.end()

    def event(self, event: QEvent) -> bool:
        if isinstance(event, QHelpEvent):  # the bar under the pointer, else the chart's own
            text = self.describe_at(QPointF(event.pos())) or self.toolTip()
            if text:
                QToolTip.showText(event.globalPos(), text, self)
            else:
                QToolTip.hideText()
                event.ignore()
            return True
        return super().event(event)

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        if QToolTip.isVisible():  # follow the pointer from bar to bar
            text = self.describe_at(event.position()) or self.toolTip()
            QToolTip.showText(event.globalPosition().toPoint(), text, self)
        super().mouseMoveEvent(event)

    @property
    def frames_drawn(self) -> int:
        return self._frame.drawn

    def _draw_frame(self, painter: QPainter) -> None:
        self.draw_title(painter)
        self.draw_frame(painter, self.plot_rect())

    def draw_title(self, painter: QPainter) -> None:
        painter.setPen(TITLE)
        painter.drawText(
            QRectF(0, 2, self.width(), self.line() + 2), Qt.AlignmentFlag.AlignCenter, self.title
        )


def _x_axis(
    painter: QPainter, area: QRectF, limit: float, units: Sequence[tuple[float, str]], caption: str
) -> None:
    """Ticks and labels under `area` for values 0..`limit`, in the unit that fits."""
    line = painter.fontMetrics().height()
    size, name = unit_for(limit, units)
    scaled = limit / size
    ticks = nice_ticks(scaled, max(1, min(5, int(area.width() / TICK_GAP))))
    step = float(ticks[1] - ticks[0]) if ticks.size > 1 else 1.0
    painter.setPen(GRID)
    painter.drawLine(area.bottomLeft(), area.bottomRight())
    for tick in ticks.tolist():
        x = area.left() + (tick / scaled * area.width() if scaled else 0.0)
        painter.setPen(GRID)
        painter.drawLine(QLineF(x, area.top(), x, area.bottom() + 4))
        painter.setPen(TEXT)
        label = QRectF(x - 40, area.bottom() + 5, 80, line)
        painter.drawText(label, Qt.AlignmentFlag.AlignHCenter, tick_text(tick, step))
    text = f"{caption} ({name})" if name else caption
    below = QRectF(area.left(), area.bottom() + line + 6, area.width(), line + 2)
    painter.drawText(below, Qt.AlignmentFlag.AlignHCenter, text)


class TimelineChart(PaintedChart):
    """A row per reply (its turn on the left), its phases as bars end to end along time."""

    def __init__(self, title: str, parent: QWidget | None = None) -> None:
        super().__init__(title, parent)
        self.bars: dict[str, BarSet] = {}
        self.rows: tuple[str, ...] = ()
        self.x_limit = 1.0

    def add_bars(self, name: str, colour: tuple[int, int, int]) -> BarSet:
        bars = BarSet(colour, {"x0": np.zeros(0), "y": np.zeros(0), "width": np.zeros(0)}, self)
        self.bars[name] = bars
        return bars

    def set_rows(self, rows: Sequence[str]) -> None:
        if tuple(rows) != self.rows:
            self.rows = tuple(rows)
            self.update()

    def set_x_limit(self, limit: float) -> None:
        if limit != self.x_limit:
            self.x_limit = limit
            self.update()

    def frame_key(self) -> tuple[object, ...]:
        return (*super().frame_key(), self.rows, self.x_limit)

    def plot_rect(self) -> QRectF:
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        widest = max((metrics.horizontalAdvance(row) for row in self.rows), default=0)
        left = max(widest, metrics.horizontalAdvance("turn 10")) + 10
        top = line + 8
        bottom = self.height() - 2 * line - 8
        return QRectF(left, top, max(self.width() - left - 12, 1), max(bottom - top, 1))

    def row_band(self, row: float, area: QRectF) -> tuple[float, float]:
        """The top and height of row `row`'s bar, in widget pixels."""
        slot = area.height() / max(len(self.rows), 1)
        return area.top() + (row + (1 - BAR_SHARE) / 2) * slot, slot * BAR_SHARE

    def x_at(self, seconds: float, area: QRectF) -> float:
        return area.left() + seconds / self.x_limit * area.width()

    def draw_frame(self, painter: QPainter, area: QRectF) -> None:
        _x_axis(painter, area, self.x_limit, SECONDS, "time")
        slot = area.height() / max(len(self.rows), 1)
        right = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        painter.setPen(TEXT)
        for index, row in enumerate(self.rows):
            y = area.top() + (index + 0.5) * slot
            text = QRectF(0, y - self.line() / 2, area.left() - 6, self.line())
            painter.drawText(text, right, row)

    def draw_data(self, painter: QPainter, area: QRectF) -> None:
        for bars in self.bars.values():
            colour = QColor(*bars.colour)
            for row, start, width in bars.spans():
                top, height = self.row_band(row, area)
                left = self.x_at(start, area)
                painter.fillRect(
                    QRectF(left, top, self.x_at(start + width, area) - left, height), colour
                )

    def describe_at(self, point: QPointF) -> str:
        area = self.plot_rect()
        for name, bars in self.bars.items():
            for row, start, width in bars.spans():
                top, height = self.row_band(row, area)
                left, right = self.x_at(start, area), self.x_at(start + width, area)
                if left <= point.x() <= max(right, left + 2) and top <= point.y() <= top + height:
                    turn = self.rows[int(row)] if 0 <= row < len(self.rows) else ""
                    return f"{turn}: {name} {format_duration(width)}"
        return ""


class TurnsChart(PaintedChart):
    """A column per turn: stacked bars on the left axis, a line of points on the right one."""

    def __init__(
        self,
        title: Sequence[tuple[str, tuple[int, int, int]]],
        left_label: str,
        right_label: str,
        point_colour: tuple[int, int, int],
        parent: QWidget | None = None,
    ) -> None:
        """`title`: its words as (text, colour) pieces, drawn one after another; the right
        axis's points and their line in `point_colour`."""
        super().__init__("".join(text for text, _colour in title), parent)
        self.title_pieces = tuple(title)
        self.left_label, self.right_label = left_label, right_label
        self.columns: list[BarSet] = []
        self.points = np.zeros(0), np.zeros(0)  # (turn, value on the right axis)
        self.point_colour = point_colour
        self.turns = 1
        self.y_limit, self.right_limit = 1.0, 1.0
        self.ticks: tuple[tuple[int, str], ...] = ()
        # What the tooltip says of a turn's column (the panel sets it).
        self.describe_turn: Callable[[int], str] = lambda _turn: ""

    def add_bars(self, colour: tuple[int, int, int]) -> BarSet:
        bars = BarSet(colour, {"x": np.zeros(0), "y0": np.zeros(0), "height": np.zeros(0)}, self)
        self.columns.append(bars)
        return bars

    def set_points(self, turns: ArrayLike, values: ArrayLike) -> None:
        self.points = np.asarray(turns, dtype=np.float64), np.asarray(values, dtype=np.float64)
        self.update()

    def getData(self) -> tuple[np.ndarray, np.ndarray]:
        """The points, as a pyqtgraph curve's (the tests read them so)."""
        return self.points

    def set_axes(
        self, turns: int, y_limit: float, right_limit: float, ticks: Sequence[tuple[int, str]]
    ) -> None:
        """`turns` columns; the left axis 0..`y_limit`, the right 0..`right_limit`; `ticks`:
        the (column, label) pairs written under the columns."""
        axes = (max(turns, 1), y_limit, right_limit, tuple(ticks))
        if axes != (self.turns, self.y_limit, self.right_limit, self.ticks):
            self.turns, self.y_limit, self.right_limit, self.ticks = axes
            self.update()

    def frame_key(self) -> tuple[object, ...]:
        return (*super().frame_key(), self.turns, self.y_limit, self.right_limit, self.ticks)

    def plot_rect(self) -> QRectF:
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        side = metrics.horizontalAdvance("00000") + 10
        top = 2 * line + 10  # the title, then the axes' names
        bottom = self.height() - line - 10
        return QRectF(side, top, max(self.width() - 2 * side, 1), max(bottom - top, 1))

    def column_x(self, turn: float, area: QRectF) -> float:
        """The centre of turn `turn`'s column, in widget pixels."""
        return area.left() + (turn + 0.5) / self.turns * area.width()

    def y_at(self, value: float, area: QRectF) -> float:
        return area.bottom() - value / self.y_limit * area.height()

    def point_at(self, turn: float, value: float) -> QPointF:
        """Where a point of the right axis's line is drawn, in widget pixels."""
        area = self.plot_rect()
        y = area.bottom() - value / self.right_limit * area.height()
        return QPointF(self.column_x(turn, area), y)

    def draw_title(self, painter: QPainter) -> None:
        metrics = painter.fontMetrics()
        x = (self.width() - metrics.horizontalAdvance(self.title)) / 2
        for text, colour in self.title_pieces:
            painter.setPen(QColor(*colour))
            painter.drawText(QPointF(x, 2 + metrics.ascent()), text)
            x += metrics.horizontalAdvance(text)

    def draw_frame(self, painter: QPainter, area: QRectF) -> None:
        line = self.line()
        painter.setPen(GRID)
        painter.drawLine(area.bottomLeft(), area.bottomRight())
        self._y_axis(painter, area, self.y_limit, left=True)
        self._y_axis(painter, area, self.right_limit, left=False)
        painter.setPen(TEXT)
        names = QRectF(4, line + 4, self.width() - 8, line + 2)
        middle = Qt.AlignmentFlag.AlignVCenter
        painter.drawText(names, Qt.AlignmentFlag.AlignLeft | middle, self.left_label)
        right_name = f"{self.right_label} ({unit_for(self.right_limit, SECONDS)[1]})"
        painter.drawText(names, Qt.AlignmentFlag.AlignRight | middle, right_name)
        for column, label in self.ticks:
            x = self.column_x(column, area)
            text = QRectF(x - 40, area.bottom() + 4, 80, line)
            painter.drawText(text, Qt.AlignmentFlag.AlignHCenter, label)

    def _y_axis(self, painter: QPainter, area: QRectF, limit: float, left: bool) -> None:
        line = self.line()
        size, _name = unit_for(limit, SECONDS) if not left else (1.0, "")
        scaled = limit / size
        ticks = nice_ticks(scaled, max(1, min(5, int(area.height() / (1.5 * line)))))
        step = float(ticks[1] - ticks[0]) if ticks.size > 1 else 1.0
        edge = area.left() if left else area.right()
        for tick in ticks.tolist():
            y = area.bottom() - (tick / scaled * area.height() if scaled else 0.0)
            painter.setPen(GRID)
            painter.drawLine(QLineF(edge - 4, y, edge, y))  # out of the left axis, into the right
            if left:
                painter.drawLine(QLineF(area.left(), y, area.right(), y))  # a faint grid line
            painter.setPen(TEXT)
            if left:
                text = QRectF(0, y - line / 2, edge - 6, line)
                align = Qt.AlignmentFlag.AlignRight
            else:
                text = QRectF(edge + 6, y - line / 2, self.width() - edge - 6, line)
                align = Qt.AlignmentFlag.AlignLeft
            painter.drawText(text, align | Qt.AlignmentFlag.AlignVCenter, tick_text(tick, step))

    def draw_data(self, painter: QPainter, area: QRectF) -> None:
        width = BAR_SHARE / self.turns * area.width()
        for bars in self.columns:
            colour = QColor(*bars.colour)
            for turn, start, height in bars.spans():
                x = self.column_x(turn, area) - width / 2
                top = self.y_at(start + height, area)
                painter.fillRect(QRectF(x, top, width, self.y_at(start, area) - top), colour)
        turns, values = self.points
        if not turns.size:
            return
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        colour = QColor(*self.point_colour)
        points = [self.point_at(t, v) for t, v in zip(turns.tolist(), values.tolist(), strict=True)]
        painter.setPen(QPen(colour, 2))
        painter.drawPolyline(points)
        painter.setBrush(colour)
        painter.setPen(QPen(colour, 1))
        for point in points:
            painter.drawEllipse(point, 3.0, 3.0)

    def describe_at(self, point: QPointF) -> str:
        area = self.plot_rect()
        if not area.contains(point):
            return ""
        turn = int((point.x() - area.left()) / area.width() * self.turns)
        return self.describe_turn(turn) if 0 <= turn < self.turns else ""


def format_duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"
