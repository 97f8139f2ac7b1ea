"""Tokens panel: the prompt after the chat template as token chips, then the reply's tokens.

Each chip is a run of text with its own character format in one QTextBrowser (one widget per
token would cost thousands of widgets for a long prompt). Chips are appended as tokens come,
never rebuilt per frame; selecting a step re-formats two chips. A click on a chip selects its
step in every panel (InternalsState.select).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

from PySide6.QtCore import QUrl
from PySide6.QtGui import QColor, QFont, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QLabel, QTextBrowser, QWidget

from engine.token_labels import quoted
from ui.panels.empty import column, fill_with_pages
from ui.panels.redraw import StatePanel
from ui.panels.state import InternalsState
from ui.panels.state.explain import tokens_line
from ui.panels.state.internals import TOKENS
from ui.panels.state.tokens import TokenTrail
from ui.panels.step_line import StepLine

EMPTY_MESSAGE = (
    "<b>Tokens</b><br>The model never sees your words, only token ids: the prompt after the "
    "chat template, special tokens and all, then the reply one token at a time. "
    "<br><br><i>Send a message to see its tokens; click one to select its step in every "
    "panel.</i>"
)
PROMPT = QColor(225, 232, 245)
REUSED = QColor(232, 232, 232)
SPECIAL = QColor(214, 196, 240)
REPLY = QColor(206, 236, 211)
SELECTED = QColor(255, 200, 40)
BYTES_TEXT = QColor(190, 90, 0)
BLOCK_CHIPS = 100  # the most chips in one paragraph (see _append)
# The most chips one redraw adds, and the time it may take adding them: a model streaming
# thousands of tokens a second left hundreds to add at each frame (~30 us each), one pass of
# the event loop long past a frame's budget. The rest are added in the frame's next slices
# (`unfinished`), each in a turn of the event loop of its own (ui.panels.docks.FRAME_SLICE_S).
CHIPS_PER_REDRAW = 200
CHIPS_SLICE_S = 0.002
CHIPS_BETWEEN_CLOCKS = 16  # chips added between two looks at the clock
VISIBLE = str.maketrans({" ": "·", "\n": "↵", "\t": "⇥"})


BACKGROUNDS = {"special": SPECIAL, "reply": REPLY, "reused": REUSED, "prompt": PROMPT}


def _kind(trail: TokenTrail, position: int) -> str:
    """What the chip at `position` is, which sets its colour and tooltip."""
    if trail.is_special(position):
        return "special"
    if position >= trail.prompt_tokens:
        return "reply"
    return "reused" if position < trail.reused_tokens else "prompt"


def _shared(old: TokenTrail, new: TokenTrail, shown: int) -> int:
    """How many of the first `shown` chips of `old` the trail `new` begins with (same ids and
    labels)."""
    limit = min(shown, len(new.ids))
    differ = (i for i in range(limit) if (old.ids[i], old.labels[i]) != (new.ids[i], new.labels[i]))
    return next(differ, limit)


@functools.cache
def _base_format(kind: str, raw_bytes: bool, selected: bool) -> QTextCharFormat:
    """What every chip of a kind shares (made once: a chip of a long reply streaming at
    thousands of tokens a second set each property of its own format again)."""
    chip = QTextCharFormat()
    chip.setAnchor(True)
    if kind == "special":
        chip.setFontWeight(QFont.Weight.Bold)
    if raw_bytes:
        chip.setForeground(BYTES_TEXT)
        chip.setFontItalic(True)
    chip.setBackground(SELECTED if selected else BACKGROUNDS[kind])
    return chip


def _kind_changes(old: TokenTrail, new: TokenTrail, kept: int) -> list[int]:
    """The positions below `kept` (chips both trails share) whose kind differs. With the same
    special ids, only positions between the two prompt ends or the two reused ends can: the
    rest are not looked at (a long prompt's every chip was, twice, at each new reply)."""
    if old.special != new.special:
        candidates: Iterable[int] = range(kept)
    else:
        bounds = ((old.prompt_tokens, new.prompt_tokens), (old.reused_tokens, new.reused_tokens))
        candidates = sorted({p for a, b in bounds for p in range(min(a, b), min(max(a, b), kept))})
    return [p for p in candidates if _kind(old, p) != _kind(new, p)]


def chip_text(label: str) -> str:
    """A token as its chip shows it: spaces and line ends visible, never empty."""
    return label.translate(VISIBLE) or "∅"


def tooltip(trail: TokenTrail, position: int) -> str:
    token_id = trail.ids[position]
    kind = "reply" if position >= trail.prompt_tokens else "prompt"
    special = ", special token of the template" if trail.is_special(position) else ""
    return f"#{position} · id {token_id} · {kind}{special} · {quoted(trail.labels[position])}"


class TokensPanel(StatePanel):
    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, TOKENS, parent)
        self.counts = QLabel("")
        self.step_line = StepLine()
        self.chips = QTextBrowser()
        self.chips.setOpenLinks(False)
        self.chips.setMouseTracking(True)
        self.chips.anchorClicked.connect(self._on_clicked)
        self.chips.highlighted.connect(self._on_hover)
        self.hover = QLabel("Hover a token to read its id.")
        self._trail: TokenTrail | None = None  # the trail the chips show
        self._starts: list[int] = []  # each chip's first character in the document
        self._in_block = 0  # chips in the document's last paragraph
        self._in_block_after: list[int] = []  # _in_block right after each chip went in
        self._marked: int | None = None  # the chip drawn as selected
        content = column([self.counts, self.step_line, self.chips, self.hover], grows=self.chips)
        self.pages = fill_with_pages(self, EMPTY_MESSAGE, content)

    @property
    def shown(self) -> int:
        """How many chips the panel shows."""
        return len(self._starts)

    def chip_format(self, position: int) -> QTextCharFormat:
        """The format of the chip at `position` (a test reads its colours)."""
        cursor = QTextCursor(self.chips.document())
        cursor.setPosition(self._starts[position] + 1)
        return cursor.charFormat()

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        state = self._state
        trail = state.trail
        self.pages.show_content(bool(trail.ids))
        # A new chat's empty trail is not drawn (its page says what the panel will show): the
        # chips stay for the next reply to keep what it shares with them.
        if trail is not self._trail and trail.ids:
            self._follow(trail)
        self._append(trail)
        self.unfinished = self.shown < len(trail.ids)
        self.counts.setText(trail.counts_line() if trail.ids else "")
        self._mark(state.selected_position if state.showing_step else None)
        self.step_line.say(tokens_line(state), state.showing_step)
        self.tracker.drawn(revisions)

    # -- chips -----------------------------------------------------------------------------

    def _follow(self, trail: TokenTrail) -> None:
        """A new reply's trail. The chips it shares with the one shown stay (a regenerated
        reply, a new chat with the same prompt, a conversation's earlier turns), re-formatted
        where their kind changed (last reply's tokens now part of the prompt); the rest go.
        Inserting a long prompt's chips again was this panel's dearest frame."""
        old = self._trail
        kept = 0 if old is None else _shared(old, trail, self.shown)
        if old is None or kept == 0:
            self.chips.clear()
        else:
            self._keep(old, trail, kept)
        self._trail, self._marked = trail, None
        del self._starts[kept:], self._in_block_after[kept:]
        self._in_block = self._in_block_after[-1] if kept else 0

    def _keep(self, old: TokenTrail, trail: TokenTrail, kept: int) -> None:
        """Drop the chips from `kept` on; give the others the format `trail` gives them."""
        cursor = QTextCursor(self.chips.document())
        cursor.beginEditBlock()
        if kept < self.shown:
            cursor.setPosition(self._starts[kept])
            cursor.movePosition(QTextCursor.MoveOperation.End, QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
        changed = set(_kind_changes(old, trail, kept))
        if self._marked is not None and self._marked < kept:
            changed.add(self._marked)
        for position in sorted(changed):
            self._reformat(cursor, trail, position)
        cursor.endEditBlock()

    def _reformat(
        self, cursor: QTextCursor, trail: TokenTrail, position: int, selected: bool = False
    ) -> None:
        """Give the chip at `position` the format `trail` gives it (selected or not)."""
        cursor.setPosition(self._starts[position])
        end = self._starts[position] + len(chip_text(trail.labels[position]))
        cursor.setPosition(end, QTextCursor.MoveMode.KeepAnchor)
        cursor.setCharFormat(self._format(trail, position, selected))

    def _append(self, trail: TokenTrail) -> None:
        if self.shown >= len(trail.ids):
            return
        bar = self.chips.verticalScrollBar()
        at_end = bar.value() >= bar.maximum() - 4
        first = self.shown
        cursor = QTextCursor(self.chips.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        gap = QTextCharFormat()
        cursor.beginEditBlock()  # the document is laid out once, not after every chip
        started = time.perf_counter()
        for position in range(self.shown, min(len(trail.ids), self.shown + CHIPS_PER_REDRAW)):
            self._starts.append(cursor.position())
            label = trail.labels[position]
            chip = self._format(trail, position, selected=position == self._marked)
            cursor.insertText(chip_text(label), chip)
            cursor.insertText(" ", gap)
            self._in_block += 1
            # A paragraph is laid out whole each time it grows: chips of a long reply in one
            # paragraph cost a layout of all of them per token (10,000 tokens: seconds of
            # stall). A new one after a line end, as the text has it, or every BLOCK_CHIPS.
            if "\n" in label or self._in_block >= BLOCK_CHIPS:
                cursor.insertBlock()
                self._in_block = 0
            self._in_block_after.append(self._in_block)
            added = position + 1 - first
            if added % CHIPS_BETWEEN_CLOCKS == 0 and time.perf_counter() - started > CHIPS_SLICE_S:
                break
        cursor.endEditBlock()
        if self._marked is not None and first <= self._marked < self.shown:
            self._show_chip(self._marked)  # selected before it arrived
        elif at_end:
            bar.setValue(bar.maximum())

    def _format(self, trail: TokenTrail, position: int, selected: bool = False) -> QTextCharFormat:
        label = trail.labels[position]
        base = _base_format(_kind(trail, position), label.startswith("<0x"), selected)
        chip = QTextCharFormat(base)  # a copy: only the link and the tooltip are the chip's own
        chip.setAnchorHref(f"token:{position}")
        chip.setToolTip(tooltip(trail, position))
        return chip

    def _mark(self, position: int | None) -> None:
        """Draw the chip at `position` as selected, and the one before as it was."""
        trail = self._trail
        if position == self._marked or trail is None:
            return
        for chip, selected in ((self._marked, False), (position, True)):
            if chip is not None and chip < self.shown:
                self._reformat(QTextCursor(self.chips.document()), trail, chip, selected)
        self._marked = position
        if position is not None and position < self.shown:
            self._show_chip(position)

    def _show_chip(self, position: int) -> None:
        cursor = QTextCursor(self.chips.document())
        cursor.setPosition(self._starts[position])
        self.chips.setTextCursor(cursor)
        self.chips.ensureCursorVisible()

    def _on_clicked(self, url: QUrl) -> None:
        self._state.select(int(url.toString().removeprefix("token:")))

    def _on_hover(self, url: QUrl) -> None:
        trail = self._trail
        if trail is None or not url.toString().startswith("token:"):
            return
        position = int(url.toString().removeprefix("token:"))
        if position < len(trail.ids):
            self.hover.setText(tooltip(trail, position))
