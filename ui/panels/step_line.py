"""The line a panel shows about the selected step while a teacher steps through a reply."""

from __future__ import annotations

from PySide6.QtWidgets import QLabel, QWidget

STYLE = "QLabel { background: #fff4c2; color: #202020; padding: 4px; font-weight: bold; }"


class StepLine(QLabel):
    """Hidden unless there is something to say (paused, stepping or a token selected)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setWordWrap(True)
        self.setStyleSheet(STYLE)
        self.setVisible(False)

    def say(self, text: str, shown: bool) -> None:
        if text != self.text():
            self.setText(text)
        visible = shown and bool(text)
        if visible != self.isVisible():
            self.setVisible(visible)
