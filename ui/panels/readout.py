"""A box for a word-wrapped label whose text changes every frame.

A label in a layout re-lays out its whole panel whenever its text changes: the layout asks it
for its size hints and its height at several widths, each one a rich-text layout, then sets
the geometry of every sibling, a costly part of each frame. In this box the label reports to the
box alone; the box lays the text out once, at its own width, and only a change of height (a
line more or less) reaches the panel's layout.
"""

from __future__ import annotations

from PySide6.QtCore import QEvent, QSize
from PySide6.QtGui import QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget


class ReadoutBox(QWidget):
    """Holds `label` at its full width and exactly the height its text needs there."""

    def __init__(self, label: QLabel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.label = label
        label.setParent(self)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._fit()

    def event(self, event: QEvent) -> bool:
        # The label asks its parent to lay out again when its text (so its size) changed.
        if event.type() == QEvent.Type.LayoutRequest:
            self._fit()
        return super().event(event)

    def resizeEvent(self, event: QResizeEvent) -> None:
        self.label.setGeometry(self.rect())
        self._fit()
        super().resizeEvent(event)

    def sizeHint(self) -> QSize:
        return QSize(self.label.sizeHint().width(), self.height())

    def minimumSizeHint(self) -> QSize:
        return QSize(self.label.minimumSizeHint().width(), self.height())

    def _fit(self) -> None:
        height = self.label.heightForWidth(max(self.width(), 1))
        if height < 0:
            height = self.label.sizeHint().height()
        if height != self.maximumHeight() or height != self.minimumHeight():
            self.setFixedHeight(height)
