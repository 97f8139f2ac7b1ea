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


# Per role: its colour on a light theme, then on a dark one.
_COLORS = {
    "user": ("#e3edfb", "#2b3a4f"),
    "assistant": ("#f6f6f6", "#2a2a2a"),
    "system": ("#fbf6e6", "#33302a"),
    "code": ("#eceff1", "#1c1c1c"),
    "border": ("#c8c8c8", "#555555"),
    "muted": ("#707070", "#9a9a9a"),
    "error": ("#b00020", "#ff8a80"),
}


def chat_colors(palette: QPalette) -> ChatColors:
    """Message backgrounds that stay readable on the current theme's text colour."""
    dark = palette.color(QPalette.ColorRole.Base).lightness() < 128
    return ChatColors(**{role: QColor(pair[dark]) for role, pair in _COLORS.items()})


def document_css(colors: ChatColors) -> str:
    """The default stylesheet of the chat document (applies to Markdown inserted as HTML)."""
    return f"""
        pre, code {{ font-family: {MONOSPACE}; }}
        code {{ background-color: {colors.code.name()}; }}
        pre {{ margin-top: 0px; margin-bottom: 0px; }}
        th {{ background-color: {colors.code.name()}; }}
        a {{ text-decoration: underline; }}
    """
