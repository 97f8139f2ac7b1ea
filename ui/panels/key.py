"""A chart's colour key as a line of text above it: a legend inside a small plot sat on the
axes or covered the data (the timeline's phase bars, the longest next-token bars)."""

from __future__ import annotations

from collections.abc import Sequence

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel


def swatch(colour: Sequence[int], text: str) -> str:
    red, green, blue = colour[:3]
    return f"<span style='color:rgb({red},{green},{blue})'>■</span>&nbsp;{text}"


def key_label(entries: Sequence[tuple[Sequence[int], str]]) -> QLabel:
    """A wrapped rich-text label: a coloured square and a name per entry."""
    label = QLabel(" &nbsp; ".join(swatch(colour, text) for colour, text in entries))
    label.setTextFormat(Qt.TextFormat.RichText)
    label.setWordWrap(True)
    return label
