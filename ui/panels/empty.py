"""A panel's content, or, before there is anything to show, a sentence that teaches.

Empty axes say nothing to someone who has not seen the panel work: each panel says instead
what it will show and what to do to see it.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QStackedWidget, QVBoxLayout, QWidget

MESSAGE_STYLE = "color: palette(text); font-size: 11pt; padding: 12px;"


class EmptyState(QStackedWidget):
    """Shows `content` once `show_content(True)`; until then a centred, wrapped message."""

    def __init__(self, message: str, content: QWidget, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.message = QLabel(message)
        self.message.setWordWrap(True)
        self.message.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.message.setTextFormat(Qt.TextFormat.RichText)
        self.message.setStyleSheet(MESSAGE_STYLE)
        self.message.setMinimumWidth(120)
        self.content = content
        self.addWidget(self.message)
        self.addWidget(content)

    @property
    def empty(self) -> bool:
        return self.currentIndex() == 0

    def show_content(self, shown: bool) -> None:
        index = 1 if shown else 0
        if index != self.currentIndex():  # a page switch re-lays the panel out: only on change
            self.setCurrentIndex(index)

    def set_message(self, text: str) -> None:
        if text != self.message.text():
            self.message.setText(text)


def fill_with_pages(panel: QWidget, message: str, content: QWidget) -> EmptyState:
    """The panel's pages (`message` until there is something to show, then `content`) as all
    of the panel, inside a small margin."""
    pages = EmptyState(message, content)
    layout = QVBoxLayout(panel)
    layout.setContentsMargins(4, 4, 4, 4)
    layout.addWidget(pages)
    return pages


def column(widgets: list[QWidget], grows: QWidget) -> QWidget:
    """`widgets` one above the other without margins; `grows` takes the height left over."""
    holder = QWidget()
    layout = QVBoxLayout(holder)
    layout.setContentsMargins(0, 0, 0, 0)
    for widget in widgets:
        layout.addWidget(widget, 1 if widget is grows else 0)
    return holder
