"""A box for a word-wrapped label whose text changes every frame.

A label in a layout re-lays out its whole panel whenever its text changes: the layout asks it
for its size hints and its height at several widths, each one a rich-text layout, then sets
the geometry of every sibling (3-4 ms a frame per panel). In this box the label reports to the
box alone; the box lays the text out once, at its own width, and only a change of height (a
line more or less) reaches the panel's layout.
"""

from __future__ import annotations

import re

from PySide6.QtCore import QEvent, QSize
from PySide6.QtGui import QFont, QFontMetricsF, QResizeEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QWidget

_DIGITS = re.compile(r"[0-9]")
# Markup and entities keep their digits: a size, a colour or a character code is no number
# that is shown.
_MARKUP = re.compile(r"(<[^>]*>|&[^;\s]*;)")


def digits_as_zero(text: str) -> str:
    """`text` with each shown digit as 0; tags and entities as they are."""
    parts = _MARKUP.split(text)
    parts[::2] = [_DIGITS.sub("0", part) for part in parts[::2]]
    return "".join(parts)


def tabular_digits(font: QFont) -> bool:
    """Whether every digit has the same advance in `font`, regular and bold."""
    bold = QFont(font)
    bold.setBold(True)
    for face in (font, bold):
        metrics = QFontMetricsF(face)
        if len({metrics.horizontalAdvance(digit) for digit in "0123456789"}) != 1:
            return False
    return True


class ReadoutBox(QWidget):
    """Holds `label` at its full width and exactly the height its text needs there."""

    def __init__(self, label: QLabel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.label = label
        label.setParent(self)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Fixed)
        self._fitted: tuple[str, str, int] | None = None  # (text, digits as 0; font; width)
        self._same_digits: tuple[QFont, bool] | None = None
        self.layouts = 0  # texts laid out to find their height (a test reads it)
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
        width = max(self.width(), 1)
        key = (self._shape_of(self.label.text()), self.label.font().key(), width)
        if key == self._fitted and self.minimumHeight() == self.maximumHeight():
            return  # only digits changed: the same lines, the same height
        self.layouts += 1
        height = self.label.heightForWidth(width)
        if height < 0:
            height = self.label.sizeHint().height()
        self._fitted = key
        if height != self.maximumHeight() or height != self.minimumHeight():
            self.setFixedHeight(height)

    def _shape_of(self, text: str) -> str:
        """The text with its digits as 0 if they all have one advance; else the text itself."""
        font = self.label.font()
        if self._same_digits is None or self._same_digits[0] != font:
            self._same_digits = (QFont(font), tabular_digits(font))
        return digits_as_zero(text) if self._same_digits[1] else text
