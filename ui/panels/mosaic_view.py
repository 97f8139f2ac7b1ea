"""The attention mosaic painted directly: one image of every head's tile, fitted into the widget
with its tiles' shape kept, each head's name on its tile, the selected step's row outlined and,
for a head shown alone, its tokens along two axes.

As a pyqtgraph view each frame moved an image item through a scene (its bounds, its view's
range, a second paint queued behind the first), and its axes laid out their labels again
whenever the range moved. Painted, a frame is one colour-table pass of the new image and one
scaled copy of it; labels, marker and axes are a few rectangles and strings.

Positions are given in view units (for the panel: keys across, buffer rows down, as the
tiles' cells are), which `set_view` maps onto the widget's pixels.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from PySide6.QtCore import QEvent, QPointF, QRect, QRectF, QSize, Qt, Signal
from PySide6.QtGui import (
    QColor,
    QFontMetricsF,
    QImage,
    QMouseEvent,
    QPainter,
    QPainterPath,
    QPaintEvent,
    QPen,
    QResizeEvent,
    QTransform,
)
from PySide6.QtWidgets import QApplication, QSizePolicy, QWidget

from ui.panels.attention_tiles import argb_table, table_pixels
from ui.panels.line_chart import BACKGROUND, TEXT

# The selected step's query row, outlined on every tile (pixels wide whatever the scale).
ROW_MARKER = QColor(255, 120, 0)
ROW_MARKER_PIXELS = 2
LABEL_FILL = QColor(0, 0, 0, 150)
LABEL_TEXT = QColor(255, 255, 255)
LABEL_PAD = 2.0
TICK_PIXELS = 4
AXIS_GAP = 4  # pixels between a tick and its text


@dataclass(frozen=True)
class ViewFit:
    """Where view units land in the widget: pixel = origin + unit * scale, per axis."""

    left: float
    top: float
    x_scale: float
    y_scale: float

    def to_widget(self, point: QPointF) -> QPointF:
        return QPointF(self.left + point.x() * self.x_scale, self.top + point.y() * self.y_scale)

    def to_view(self, point: QPointF) -> QPointF:
        return QPointF(
            (point.x() - self.left) / self.x_scale, (point.y() - self.top) / self.y_scale
        )

    def transform(self) -> QTransform:
        return QTransform(self.x_scale, 0.0, 0.0, self.y_scale, self.left, self.top)


def fit_view(area: QRectF, rect: QRectF, ratio: float) -> ViewFit:
    """`rect` (view units) as large as `area` allows, centred, x pixels per unit `ratio`
    times y's (pyqtgraph's locked aspect)."""
    y_scale = min(area.height() / rect.height(), area.width() / (rect.width() * ratio))
    x_scale = ratio * y_scale
    left = area.left() + (area.width() - rect.width() * x_scale) / 2 - rect.left() * x_scale
    top = area.top() + (area.height() - rect.height() * y_scale) / 2 - rect.top() * y_scale
    return ViewFit(left, top, x_scale, y_scale)


class TokenAxis:
    """Token text along one side of the mosaic: `ticks` are (view position, text); `shown`
    while a lone head's tokens each have room."""

    def __init__(self, side: str) -> None:
        self.side = side  # "top": keys, "left": query rows
        self.ticks: tuple[tuple[float, str], ...] = ()
        self.shown = False


def colour_pixels(image: np.ndarray, levels: tuple[float, float], colours: list[int]) -> QImage:
    """`image` through a 256-entry colour table as 32-bit pixels, entries as pyqtgraph picked
    them: (value - low) * 256 / span."""
    low, high = levels
    scaled = (image - np.float32(low)) * np.float32(256 / (high - low))
    return table_pixels(np.clip(scaled, 0, 255, out=scaled).astype(np.uint8), colours)


class MosaicView(QWidget):
    """An image over a view rectangle, fitted to the widget at a fixed aspect, with labels at
    screen size, one outlined path and two token axes. Emits where the pointer is (view units)
    and where it was clicked (widget pixels)."""

    hovered = Signal(QPointF)
    clicked = Signal(QPointF)
    resized = Signal()

    def __init__(self, lut: np.ndarray, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lut = lut  # [256, 3 or 4]: entry 0 the gaps' background
        self._colours = argb_table(lut)
        self.image: np.ndarray | None = None  # the values as last set
        self.qimage: QImage | None = None  # their colours
        self.levels = (0.0, 1.0)
        self._rect = QRectF()  # the view units the image spans
        self._ratio = 1.0
        self.labels: tuple[tuple[str, QPointF], ...] = ()  # (text, its top-right in view units)
        self.marker: QPainterPath | None = None  # in view units
        self.key_axis, self.query_axis = TokenAxis("top"), TokenAxis("left")
        self._pressed_at: QPointF | None = None
        self._axes_room = (0.0, 0.0)  # (left, top) pixels the shown axes take
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)

    def sizeHint(self) -> QSize:
        return QSize(600, 480)  # as the pyqtgraph view it replaced: the docks keep their sizes

    def minimumSizeHint(self) -> QSize:
        return QSize(68, 68)

    # -- what it shows ----------------------------------------------------------------------

    def set_image(self, image: np.ndarray, levels: tuple[float, float]) -> None:
        self.image, self.levels = image, levels
        self.qimage = colour_pixels(image, levels, self._colours)
        self.update()

    @property
    def view_rect(self) -> QRectF:
        """The view units the image spans."""
        return QRectF(self._rect)

    def set_view(self, rect: QRectF, ratio: float) -> None:
        """The image spans `rect` (view units); x pixels per unit are `ratio` times y's."""
        if (rect, ratio) != (self._rect, self._ratio):
            self._rect, self._ratio = QRectF(rect), ratio
            self.update()

    def set_labels(self, labels: Sequence[tuple[str, QPointF]]) -> None:
        labels = tuple(labels)
        if labels != self.labels:
            self.labels = labels
            self.update()

    def set_marker(self, path: QPainterPath | None) -> None:
        if path is not self.marker:
            self.marker = path
            self.update()

    def set_axes(
        self, queries: Sequence[tuple[float, str]], keys: Sequence[tuple[float, str]]
    ) -> None:
        """Show token text: `queries` down the left, `keys` across the top."""
        for axis, ticks in ((self.query_axis, queries), (self.key_axis, keys)):
            axis.ticks, axis.shown = tuple(ticks), True
        self._axes_room = self._room_for(queries, bool(keys))
        self.update()

    def hide_axes(self) -> None:
        for axis in (self.query_axis, self.key_axis):
            axis.ticks, axis.shown = (), False
        self._axes_room = (0.0, 0.0)
        self.update()

    def clear(self) -> None:
        self.image = self.qimage = self.marker = None
        self.labels = ()
        self.hide_axes()

    # -- geometry ---------------------------------------------------------------------------

    def plot_rect(self) -> QRectF:
        """Where the image is fitted: the widget less the room the shown axes take (measured
        when they were set: every paint and pointer move asks)."""
        return self._area(*self._axes_room)

    def area_for(self, queries: Sequence[tuple[float, str]], keys: bool) -> QRectF:
        """The plot's area with `queries` labelled down the left and, if `keys`, a line of key
        labels across the top."""
        return self._area(*self._room_for(queries, keys))

    def _room_for(self, queries: Sequence[tuple[float, str]], keys: bool) -> tuple[float, float]:
        """(left, top): the pixels the query labels and a line of key labels take."""
        metrics = QFontMetricsF(self.font())
        left = top = 0.0
        if queries:
            widest = max(metrics.horizontalAdvance(text) for _at, text in queries)
            left = widest + AXIS_GAP + TICK_PIXELS + 2
        if keys:
            top = metrics.height() + AXIS_GAP + TICK_PIXELS
        return left, top

    def _area(self, left: float, top: float) -> QRectF:
        return QRectF(left, top, max(self.width() - left, 1.0), max(self.height() - top, 1.0))

    def fit(self) -> ViewFit | None:
        """How view units map to the widget now; None before there is anything to show."""
        if self.image is None or self._rect.isEmpty():
            return None
        return fit_view(self.plot_rect(), self._rect, self._ratio)

    def map_from_view(self, point: QPointF) -> QPointF:
        fit = self.fit()
        return QPointF(point) if fit is None else fit.to_widget(point)

    def map_to_view(self, point: QPointF) -> QPointF | None:
        fit = self.fit()
        return None if fit is None else fit.to_view(point)

    def image_to_view(self, point: QPointF) -> QPointF:
        """A point of the image (its pixels) in view units."""
        assert self.image is not None
        height, width = self.image.shape
        rect = self._rect
        return QPointF(
            rect.left() + point.x() * rect.width() / width,
            rect.top() + point.y() * rect.height() / height,
        )

    def axis_rect(self, axis: TokenAxis) -> QRectF:
        """Where `axis` is drawn: left of the plot (queries) or over it (keys); empty hidden."""
        if not axis.shown:
            return QRectF()
        area = self.plot_rect()
        if axis.side == "left":
            return QRectF(0, area.top(), area.left(), area.height())
        return QRectF(area.left(), 0, area.width(), area.top())

    def label_rect(self, text: str, corner: QPointF) -> QRectF:
        """A label's box in the widget: the font's size, its top-right at `corner` (widget)."""
        metrics = QFontMetricsF(self.font())
        width = metrics.horizontalAdvance(text) + 2 * LABEL_PAD
        height = metrics.height() + 2 * LABEL_PAD
        return QRectF(corner.x() - width, corner.y(), width, height)

    # -- painting ---------------------------------------------------------------------------

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        fit = self.fit()
        if fit is None or self.qimage is None:
            painter.fillRect(self.rect(), BACKGROUND)
        else:
            corners = self._rect.topLeft(), self._rect.bottomRight()
            target = QRectF(*(fit.to_widget(corner) for corner in corners))
            self._fill_around(painter, target.toRect().adjusted(1, 1, -1, -1))
            painter.drawImage(target, self.qimage)
            self._paint_marker(painter, fit)
            self._paint_labels(painter, fit)
            self._paint_axes(painter, fit, target)
        painter.end()

    def _fill_around(self, painter: QPainter, inside: QRect) -> None:
        """The background everywhere but `inside` (the image covers it: filling it first would
        write most of the widget's pixels twice a paint)."""
        whole = self.rect()
        if inside.isEmpty():
            painter.fillRect(whole, BACKGROUND)
            return
        top, bottom = inside.top(), inside.bottom()
        painter.fillRect(QRect(0, 0, whole.width(), top), BACKGROUND)
        painter.fillRect(
            QRect(0, bottom + 1, whole.width(), whole.height() - bottom - 1), BACKGROUND
        )
        painter.fillRect(QRect(0, top, inside.left(), inside.height()), BACKGROUND)
        painter.fillRect(
            QRect(inside.right() + 1, top, whole.width() - inside.right() - 1, inside.height()),
            BACKGROUND,
        )

    def _paint_marker(self, painter: QPainter, fit: ViewFit) -> None:
        if self.marker is None:
            return
        pen = QPen(ROW_MARKER, ROW_MARKER_PIXELS)
        pen.setCosmetic(True)
        painter.setPen(pen)
        painter.setBrush(Qt.BrushStyle.NoBrush)
        painter.drawPath(fit.transform().map(self.marker))

    def _paint_labels(self, painter: QPainter, fit: ViewFit) -> None:
        painter.setFont(self.font())
        for text, corner in self.labels:
            box = self.label_rect(text, fit.to_widget(corner))
            painter.fillRect(box, LABEL_FILL)
            painter.setPen(LABEL_TEXT)
            painter.drawText(box, Qt.AlignmentFlag.AlignCenter, text)

    def _paint_axes(self, painter: QPainter, fit: ViewFit, image: QRectF) -> None:
        """The token axes beside `image` (where the image is in the widget)."""
        painter.setPen(TEXT)
        painter.setFont(self.font())
        area = self.plot_rect()
        if self.query_axis.shown:
            self._paint_query_axis(painter, fit, area, image)
        if self.key_axis.shown:
            self._paint_key_axis(painter, fit, area, image)

    def _paint_query_axis(
        self, painter: QPainter, fit: ViewFit, area: QRectF, image: QRectF
    ) -> None:
        """The query rows' tokens down the left, right-aligned against their ticks."""
        height = QFontMetricsF(self.font()).height()
        edge = area.left() - 1
        painter.drawLine(QPointF(edge, image.top()), QPointF(edge, image.bottom()))
        right_aligned = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
        for at, text in self.query_axis.ticks:
            y = fit.top + at * fit.y_scale
            painter.drawLine(QPointF(edge - TICK_PIXELS, y), QPointF(edge, y))
            box = QRectF(0, y - height / 2, edge - TICK_PIXELS - AXIS_GAP, height)
            painter.drawText(box, right_aligned, text)

    def _paint_key_axis(self, painter: QPainter, fit: ViewFit, area: QRectF, image: QRectF) -> None:
        """The keys' tokens across the top; one that would overlap the last drawn is left out."""
        metrics = QFontMetricsF(self.font())
        edge = area.top() - 1
        painter.drawLine(QPointF(image.left(), edge), QPointF(image.right(), edge))
        after = -np.inf  # where the last label drawn ends
        for at, text in self.key_axis.ticks:
            x = fit.left + at * fit.x_scale
            painter.drawLine(QPointF(x, edge - TICK_PIXELS), QPointF(x, edge))
            width = metrics.horizontalAdvance(text)
            if x - width / 2 < after + 2:
                continue
            after = x + width / 2
            painter.drawText(
                QRectF(x - width / 2, 0, width, metrics.height()),
                Qt.AlignmentFlag.AlignCenter,
                text,
            )

    # -- the pointer ------------------------------------------------------------------------

    def mouseMoveEvent(self, event: QMouseEvent) -> None:
        point = self.map_to_view(event.position())
        if point is not None and self.plot_rect().contains(event.position()):
            self.hovered.emit(point)
        super().mouseMoveEvent(event)

    def mousePressEvent(self, event: QMouseEvent) -> None:
        if event.button() == Qt.MouseButton.LeftButton:
            self._pressed_at = event.position()
        super().mousePressEvent(event)

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        """A click: pressed and released in about the same place (a drag is none)."""
        pressed, self._pressed_at = self._pressed_at, None
        if event.button() == Qt.MouseButton.LeftButton and pressed is not None:
            moved = (event.position() - pressed).manhattanLength()
            if moved < QApplication.startDragDistance():
                self.clicked.emit(event.position())
        super().mouseReleaseEvent(event)

    def changeEvent(self, event: QEvent) -> None:
        if event.type() == QEvent.Type.FontChange and self.query_axis.shown:  # labels resized
            self._axes_room = self._room_for(self.query_axis.ticks, bool(self.key_axis.ticks))
        super().changeEvent(event)

    def resizeEvent(self, event: QResizeEvent) -> None:
        super().resizeEvent(event)
        self.resized.emit()
