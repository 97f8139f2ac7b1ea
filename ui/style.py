"""Colours and the document stylesheet of the chat, derived from the palette (light or dark)."""

from __future__ import annotations

from dataclasses import dataclass

from PySide6.QtGui import QColor, QPalette

MONOSPACE = "'DejaVu Sans Mono', 'Menlo', 'Consolas', monospace"


@dataclass(frozen=True)
class ChatColors:
    user: QColor
    assistant: QColor
    system: QColor
    code: QColor
    border: QColor
    muted: QColor
    error: QColor


def chat_colors(palette: QPalette) -> ChatColors:
    """Message backgrounds that stay readable on the current theme's text colour."""
    dark = palette.color(QPalette.ColorRole.Base).lightness() < 128
    if dark:
        return ChatColors(
            user=QColor("#2b3a4f"),
            assistant=QColor("#2a2a2a"),
            system=QColor("#33302a"),
            code=QColor("#1c1c1c"),
            border=QColor("#555555"),
            muted=QColor("#9a9a9a"),
            error=QColor("#ff8a80"),
        )
    return ChatColors(
        user=QColor("#e3edfb"),
        assistant=QColor("#f6f6f6"),
        system=QColor("#fbf6e6"),
        code=QColor("#eceff1"),
        border=QColor("#c8c8c8"),
        muted=QColor("#707070"),
        error=QColor("#b00020"),
    )


def document_css(colors: ChatColors) -> str:
    """The default stylesheet of the chat document (applies to Markdown inserted as HTML)."""
    return f"""
        pre, code {{ font-family: {MONOSPACE}; }}
        code {{ background-color: {colors.code.name()}; }}
        pre {{ margin-top: 0px; margin-bottom: 0px; }}
        th {{ background-color: {colors.code.name()}; }}
        a {{ text-decoration: underline; }}
    """
