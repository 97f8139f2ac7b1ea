"""The message box: Enter sends, Shift+Enter starts a new line."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import QPlainTextEdit, QWidget

PLACEHOLDER = "Message the model… (Enter sends, Shift+Enter for a new line)"
EMPTY_MESSAGE = "Nothing to send: the message is empty."


class InputBox(QPlainTextEdit):
    """Emits `submitted(text)` on Enter; `refused(reason)` when there is nothing to send or
    sending is paused (while a reply streams). The text stays in the box when refused."""

    submitted = Signal(str)
    refused = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setPlaceholderText(PLACEHOLDER)
        self.setTabChangesFocus(True)
        lines = 3
        margins = self.contentsMargins()
        self.setFixedHeight(
            self.fontMetrics().lineSpacing() * lines
            + int(self.document().documentMargin() * 2)
            + margins.top()
            + margins.bottom()
            + 4
        )
        self._sending_enabled = True
        self._paused_reason = "A reply is still streaming: press Esc to stop it."

    def set_sending_enabled(self, enabled: bool, reason: str = "") -> None:
        """Typing stays possible while sending is off; `reason` is what Enter then reports."""
        self._sending_enabled = enabled
        if reason:
            self._paused_reason = reason

    @property
    def sending_enabled(self) -> bool:
        return self._sending_enabled

    def submit(self) -> bool:
        """Send the text if there is any and sending is on; True if it was sent."""
        text = self.toPlainText()
        if not text.strip():
            self.refused.emit(EMPTY_MESSAGE)
            return False
        if not self._sending_enabled:
            self.refused.emit(self._paused_reason)
            return False
        self.clear()
        self.submitted.emit(text.strip("\n"))
        return True

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")  # Shift+Enter would otherwise insert U+2028
            else:
                self.submit()
            event.accept()
            return
        super().keyPressEvent(event)
