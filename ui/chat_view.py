"""The conversation: one framed block per message, streamed replies, Markdown once complete.

A reply streams in as plain text at the end of the reply's frame, so nothing above it is touched.
Streamed text is shown at most every STREAM_FRAME_MS, in one edit block: each insertion lays
the reply out and repaints the view (the text, the scroll bar), so drawing every token of a fast
model costs the GUI thread more than the reader gains (a reader does not need more than 10
updates a second). The window slows it down to SLOWEST_STREAM_FRAME_MS (`set_stream_interval`)
when it is over its CPU budget (ui.panels.docks.WINDOW_CPU_SHARE): on two cores each update
takes from the model the window shows.
Tokens delivered together (ui.conversation.ReplyTokens) are one insertion; text that arrives
a frame or more after the last one drawn is drawn at once, the rest when its frame is due.
When the reply ends, its frame content is replaced once by the rendered Markdown.
The view keeps no messages of its own: it draws a ui.conversation.Conversation's changes.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Sequence

import markdown
from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import (
    QColor,
    QFont,
    QMouseEvent,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFrameFormat,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

from engine.settings import Message
from ui.confidence import TokenConfidence, confidences, describe, tint
from ui.conversation import (
    Added,
    Change,
    Conversation,
    Entry,
    ReplyAbandoned,
    ReplyEnded,
    ReplyStarted,
    ReplyTokens,
    Reset,
    Truncated,
)
from ui.reply_stats import stats_line
from ui.style import FLAT_SCROLL_BAR_CSS, ChatColors, chat_colors, document_css

ROLE_LABELS = {"user": "You", "assistant": "Assistant", "system": "System prompt"}
BUBBLE_INDENT = 48  # px: user messages lean right, replies left, like chat bubbles
STREAM_FRAME_MS = 100  # streamed text is drawn at most 10 times a second
SLOWEST_STREAM_FRAME_MS = 500  # ... and at least twice a second, as the panels at their slowest

_CODE_BLOCK = re.compile(r"<pre><code(?: class=\"[^\"]*\")?>(.*?)</code></pre>", re.DOTALL)


class MarkdownRenderer:
    """Markdown to the HTML subset QTextDocument draws; raw HTML in the text stays text."""

    def __init__(self, colors: ChatColors) -> None:
        self._colors = colors
        self._md = markdown.Markdown(extensions=["fenced_code", "tables"])
        # A model's "<div>" or "<script>" is shown as typed, never interpreted.
        self._md.preprocessors.deregister("html_block")
        self._md.inlinePatterns.deregister("html")

    def render(self, text: str) -> str:
        body = self._md.reset().convert(text)
        body = _CODE_BLOCK.sub(self._code_block, body)
        return body.replace(
            "<table>",
            f'<table border="1" cellspacing="0" cellpadding="4" '
            f'style="border-collapse: collapse; border-color: {self._colors.border.name()}">',
        )

    def _code_block(self, match: re.Match[str]) -> str:
        # A one-cell table gives the block padding and a background across its full width.
        code = match.group(1).rstrip("\n")
        return (
            f'<table width="100%" cellspacing="0" cellpadding="8" '
            f'bgcolor="{self._colors.code.name()}"><tr><td><pre>{code}</pre></td></tr></table>'
        )


class ChatView(QTextBrowser):
    """Draws a Conversation (its own when none is given) and follows its changes.

    Roles: "user", "assistant", "system". Notes (`add_note`) are lines outside the
    conversation, e.g. why a reply failed; they are not messages.
    """

    # A click on the reply in progress: the step (token index) whose text was clicked
    token_clicked = Signal(int)

    def __init__(
        self, conversation: Conversation | None = None, parent: QWidget | None = None
    ) -> None:
        super().__init__(parent)
        self.setOpenExternalLinks(True)
        self.setUndoRedoEnabled(False)
        self.verticalScrollBar().setStyleSheet(FLAT_SCROLL_BAR_CSS)
        self._colors = chat_colors(self.palette())
        self.document().setDefaultStyleSheet(document_css(self._colors))
        self.document().setDocumentMargin(8)
        self._renderer = MarkdownRenderer(self._colors)
        self._reply_cursor: QTextCursor | None = None
        self._reply_start = 0
        # Replies drawn token by token, each tinted by its probability (ui.confidence)
        self.confidence_shown = False
        self._redraw_after_reply = False
        self._pending: list[str] = []  # streamed, shown at the next stream frame
        self._shown_at = -float("inf")  # time.monotonic() of the last streamed text drawn
        self.stream_updates = 0  # insertions of streamed text, ever (tests count them)
        self._stream_timer = QTimer(self)
        self._stream_timer.setSingleShot(True)
        self._stream_timer.setInterval(STREAM_FRAME_MS)
        self._stream_timer.timeout.connect(self._show_pending)
        self.stream_interval_ms = STREAM_FRAME_MS
        self.conversation = conversation if conversation is not None else Conversation()
        self.conversation.subscribe(self._on_change)
        self._redraw(self.conversation.entries)

    # -- reading -------------------------------------------------------------------------------

    def messages(self) -> list[Message]:
        """The complete messages shown, in order (a reply still streaming is not included)."""
        return self.conversation.messages()

    @property
    def replying(self) -> bool:
        return self._reply_cursor is not None

    def reply_text(self) -> str:
        """The text of the reply streaming in so far, drawn or waiting for its frame."""
        reply = self.conversation.reply
        return reply.text if reply is not None and self.replying else ""

    def step_at(self, position: int) -> int | None:
        """The step of the reply in progress whose text holds document `position`, or None
        outside it. A finished reply is redrawn as Markdown, whose text no longer lines up
        with its tokens: only the reply streaming (or held, when a teacher steps) has steps."""
        reply = self.conversation.reply
        if self._reply_cursor is None or reply is None or position < self._reply_start:
            return None
        self.flush()  # the drawn text is then every token's text, in order
        offset = position - self._reply_start
        for step, end in enumerate(itertools.accumulate(len(part) for part in reply.parts)):
            if offset < end:
                return step
        return None

    def mouseReleaseEvent(self, event: QMouseEvent) -> None:
        super().mouseReleaseEvent(event)
        if event.button() != Qt.MouseButton.LeftButton or self.textCursor().hasSelection():
            return
        step = self.step_at(self.cursorForPosition(event.position().toPoint()).position())
        if step is not None:
            self.token_clicked.emit(step)

    def toPlainText(self) -> str:
        """The transcript as text, with the streamed text that waits for its frame."""
        self.flush()
        return super().toPlainText()

    def flush(self) -> None:
        """Draw the streamed text that waits for the next stream frame now."""
        self._stream_timer.stop()
        self._show_pending()

    def show_confidence(self, on: bool) -> None:
        """Tint each token of the finished replies by the probability the model gave it (its
        probability and runners-up on hover), or draw them as Markdown again. A reply still
        streaming is tinted once it ends."""
        if on == self.confidence_shown:
            return
        self.confidence_shown = on
        if self.replying:
            self._redraw_after_reply = True
        else:
            self._redraw(self.conversation.entries)

    def add_note(self, text: str, error: bool = False) -> None:
        """A line outside the conversation, e.g. why a reply failed; not part of messages()."""
        at_bottom = self._at_bottom()
        cursor = self._end_cursor()
        cursor.beginEditBlock()
        cursor.insertBlock()
        fmt = QTextCharFormat()
        fmt.setForeground(self._colors.error if error else self._colors.muted)
        fmt.setFontItalic(True)
        cursor.insertText(text, fmt)
        cursor.endEditBlock()
        self._follow(at_bottom)

    # -- following the conversation ------------------------------------------------------------

    def _on_change(self, change: Change) -> None:
        if isinstance(change, Reset | Truncated):
            self._redraw(change.entries)
        elif isinstance(change, Added):
            self._draw(change.entry)
        elif isinstance(change, ReplyStarted):
            self._begin_reply()
        elif isinstance(change, ReplyTokens):
            self._append_reply(change.text)
        elif isinstance(change, ReplyEnded):
            self._end_reply(change.entry)
        elif isinstance(change, ReplyAbandoned):
            self.flush()
            self._reply_cursor = None

    def _begin_reply(self) -> None:
        """Open an assistant message that streamed text goes into."""
        if self._reply_cursor is not None:
            self.flush()
        at_bottom = self._at_bottom()
        cursor = self._end_cursor()
        cursor.beginEditBlock()
        self._open_frame(cursor, "assistant")
        cursor.endEditBlock()
        self._reply_start = cursor.position()
        self._reply_cursor = cursor
        self._follow(at_bottom)

    def set_stream_interval(self, interval_ms: int) -> None:
        """Draw streamed text every `interval_ms` (STREAM_FRAME_MS to SLOWEST_STREAM_FRAME_MS):
        as often as the window's panels draw, within those bounds."""
        self.stream_interval_ms = min(max(interval_ms, STREAM_FRAME_MS), SLOWEST_STREAM_FRAME_MS)

    def _append_reply(self, text: str) -> None:
        """Stream text into the open reply: drawn as plain text now if the last text was drawn
        a stream frame ago or more, else when that frame is due (within stream_interval_ms)."""
        if self._reply_cursor is None or not text:
            return
        self._pending.append(text)
        if self._stream_timer.isActive():
            return
        wait_ms = self.stream_interval_ms - (time.monotonic() - self._shown_at) * 1000
        if wait_ms <= 0:
            self._show_pending()
        else:
            self._stream_timer.start(max(1, round(wait_ms)))

    def _end_reply(self, entry: Entry) -> None:
        """Replace the streamed text by the reply rendered as Markdown, with its stats line."""
        if self._reply_cursor is None:
            self._draw(entry)
            return
        at_bottom = self._at_bottom()
        cursor = self._reply_cursor
        frame_end = cursor.currentFrame().lastPosition()
        cursor.setPosition(self._reply_start)
        cursor.setPosition(frame_end, QTextCursor.MoveMode.KeepAnchor)
        cursor.beginEditBlock()
        cursor.removeSelectedText()
        self._write_body(cursor, entry)
        cursor.endEditBlock()
        self._reply_cursor = None
        self._drop_pending()
        self._follow(at_bottom)
        if self._redraw_after_reply:
            self._redraw_after_reply = False
            self._redraw(self.conversation.entries)

    # -- streaming -----------------------------------------------------------------------------

    def _show_pending(self) -> None:
        if self._reply_cursor is None or not self._pending:
            return
        text = "".join(self._pending)
        self._drop_pending()
        at_bottom = self._at_bottom()
        self._reply_cursor.beginEditBlock()
        self._reply_cursor.insertText(text)
        self._reply_cursor.endEditBlock()
        self._follow(at_bottom)
        self._shown_at = time.monotonic()
        self.stream_updates += 1

    def _drop_pending(self) -> None:
        self._pending = []
        self._stream_timer.stop()

    # -- drawing -------------------------------------------------------------------------------

    def _draw(self, entry: Entry) -> None:
        at_bottom = self._at_bottom()
        cursor = self._end_cursor()
        cursor.beginEditBlock()
        self._open_frame(cursor, entry.role)
        self._write_body(cursor, entry)
        cursor.endEditBlock()
        self._follow(at_bottom)

    def _redraw(self, entries: Sequence[Entry]) -> None:
        self._reply_cursor = None
        self._drop_pending()
        super().clear()
        for entry in entries:
            self._draw(entry)

    def _open_frame(self, cursor: QTextCursor, role: str) -> None:
        """Insert the message's frame and its role label; the cursor ends in the body block."""
        fmt = QTextFrameFormat()
        fmt.setBackground(self._background(role))
        fmt.setPadding(8)
        fmt.setTopMargin(4)
        fmt.setBottomMargin(4)
        fmt.setBorder(0)
        if role == "user":
            fmt.setLeftMargin(BUBBLE_INDENT)
        else:
            fmt.setRightMargin(BUBBLE_INDENT)
        cursor.insertFrame(fmt)
        label = QTextCharFormat()
        label.setFontWeight(QFont.Weight.Bold)
        label.setForeground(self._colors.muted)
        cursor.insertText(ROLE_LABELS.get(role, role), label)
        cursor.insertBlock()
        cursor.setCharFormat(QTextCharFormat())

    def _write_body(self, cursor: QTextCursor, entry: Entry) -> None:
        tinted = confidences(entry.confidence) if self.confidence_shown else ()
        if entry.role == "assistant" and tinted:
            self._write_tinted(cursor, tinted)
        elif entry.role == "assistant":
            text = entry.text
            cursor.insertHtml(self._renderer.render(text) if text.strip() else "<i>(no text)</i>")
        else:
            cursor.insertText(entry.text, QTextCharFormat())
        stats = stats_line(entry.stats)
        if not entry.complete:
            stats = " · ".join(part for part in (stats, "incomplete: cut off") if part)
        if stats:
            # A plain block: one inheriting the reply's last block would be its list's next
            # item, or a line of its code block.
            cursor.insertBlock(QTextBlockFormat())
            fmt = QTextCharFormat()
            fmt.setForeground(self._colors.muted)
            fmt.setFontPointSize(max(self.font().pointSizeF() - 1, 6))
            cursor.insertText(stats, fmt)

    def _write_tinted(self, cursor: QTextCursor, tokens: Sequence[TokenConfidence]) -> None:
        """The reply as its tokens' pieces, each on a background as red as the model was
        unsure of it, its probability and runners-up as the tooltip."""
        for token in tokens:
            fmt = QTextCharFormat()
            fmt.setBackground(QColor(*tint(token.prob)))
            fmt.setToolTip(describe(token))
            cursor.insertText(token.text, fmt)
        cursor.setCharFormat(QTextCharFormat())

    def _background(self, role: str) -> QColor:
        return {"user": self._colors.user, "system": self._colors.system}.get(
            role, self._colors.assistant
        )

    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor

    # -- scrolling: follow the stream only if the reader is at the bottom ------------------------

    def _at_bottom(self) -> bool:
        bar = self.verticalScrollBar()
        return bar.value() >= bar.maximum() - 4

    def _follow(self, was_at_bottom: bool) -> None:
        if was_at_bottom:
            bar = self.verticalScrollBar()
            bar.setValue(bar.maximum())
