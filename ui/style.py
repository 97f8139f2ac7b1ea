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


# The chat's scroll bar repaints with every streamed update (its range grows with the text).
# The platform's own style draws it with gradients and arrow buttons, at about a millisecond a
# paint; this flat one, in the palette's colours, paints in a few hundredths of that.
FLAT_SCROLL_BAR_CSS = """
QScrollBar:vertical { background: palette(base); width: 12px; margin: 0; }
QScrollBar::handle:vertical {
    background: palette(mid); min-height: 24px; border-radius: 4px; margin: 2px;
}
QScrollBar::handle:vertical:hover, QScrollBar::handle:vertical:pressed {
    background: palette(dark);
}
QScrollBar::add-line:vertical, QScrollBar::sub-line:vertical { height: 0; }
QScrollBar::add-page:vertical, QScrollBar::sub-page:vertical { background: none; }
"""
