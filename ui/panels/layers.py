"""Layers panel: where in the stack the next token forms (a logit lens of one step).

A grid of layers (the last at the top) by each layer's best guesses, shaded by probability,
the token the step chose outlined wherever it appears; at the right, that token's rank and
probability at each layer; above, one sentence with the real numbers. It shows the selected
step, else the latest. The lens is not sent per token: the panel asks the engine for the step
it shows (`lens_wanted`) and draws the answer (`set_lens`), one ask at a time; the engine keeps
steps only while the panel is on screen (`watch_changed`). Each ask is every layer's product
through the output head, which the engine computes between two of a running reply's steps and
so holds the next one up by that long (`LayerLens.seconds`: tens of ms on the bundled model on
a CPU, over 100 ms with a 150,000-token vocabulary). Following the latest
step of a running reply, the panel therefore asks no more often than keeps that under
LENS_SHARE of the model's time (and says so under the grid), at most every FOLLOW_FLOOR_S;
before the first answer tells the cost, every FOLLOW_INTERVAL_S. A new reply is first asked for
once it has decoded for an interval; its end, a selected step and a teacher's step are asked
for at once.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QRectF, Qt, Signal
from PySide6.QtGui import QColor, QFontMetrics, QHideEvent, QPainter, QPaintEvent, QShowEvent
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from engine.events import LayerLens
from engine.token_labels import quoted
from ui.panels.empty import fill_with_pages
from ui.panels.redraw import StatePanel, Throttle
from ui.panels.state import NEXT_TOKEN, InternalsState
from ui.panels.state.lens import EMPTY_TEXT, LensBook, lens_sentence

COLUMNS = 5  # guesses a layer shows
MIN_TEXT_PX = 7  # rows lower than this show the shades alone
BACKGROUND = QColor(0, 0, 0)
TEXT = QColor(220, 220, 220)
DIM = QColor(150, 150, 150)
CELL = (66, 133, 244)  # a guess's shade at probability 1
CHOSEN = QColor(217, 48, 37)
FOLLOW_INTERVAL_S = 1.0  # following a reply before a lens's cost is known: an ask this often
FOLLOW_FLOOR_S = 0.2  # however cheap the lens, no more often than this
LENS_SHARE = 0.02  # of the model's time that following a running reply's lens may take


def cell_colour(prob: float) -> QColor:
    """Darker for a less likely guess; the square root so that 5% still shows."""
    share = max(0.0, min(1.0, prob)) ** 0.5
    return QColor(*(int(c * share) for c in CELL))


class LensGrid(QWidget):
    """The painted grid of one LayerLens (nothing while it has none)."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.lens: LayerLens | None = None
        self.setAttribute(Qt.WidgetAttribute.WA_OpaquePaintEvent)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.setMinimumHeight(120)

    def set_lens(self, lens: LayerLens | None) -> None:
        if lens is not self.lens:
            self.lens = lens
            self.update()

    def _cells(self) -> Callable[[int, int], QRectF]:
        """(row, column) -> the cell's rectangle: row 0 is the last layer, column COLUMNS the
        chosen token's rank. The geometry for the widget's size and font is worked out once:
        a paint asks for a few hundred cells, and font metrics per cell were much of its time."""
        lens = self.lens
        layers = lens.layers if lens is not None else 1
        metrics = QFontMetrics(self.font())
        line = metrics.height()
        label = metrics.horizontalAdvance("layer 00") + 8
        width = (self.width() - label) / (COLUMNS + 1)
        height = max((self.height() - line - 4) / layers, 1.0)

        def cell(row: int, column: int) -> QRectF:
            return QRectF(label + column * width, line + 4 + row * height, width, height)

        return cell

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.fillRect(self.rect(), BACKGROUND)
        lens = self.lens
        if lens is not None:
            self._paint(painter, lens)
        painter.end()

    def _paint(self, painter: QPainter, lens: LayerLens) -> None:
        centre = Qt.AlignmentFlag.AlignCenter
        cell_rect = self._cells()
        head = cell_rect(0, COLUMNS)
        painter.setPen(DIM)
        painter.drawText(QRectF(0, 0, self.width(), head.top()), centre, "best guesses →")
        painter.drawText(QRectF(head.left(), 0, head.width(), head.top()), centre, "chosen")
        # Rows lower than a line of text: the guesses' text in a font that fits the row
        row_height = cell_rect(0, 0).height()
        small = row_height < QFontMetrics(self.font()).height()
        font = painter.font()
        if small:
            font.setPixelSize(max(MIN_TEXT_PX, int(row_height) - 1))
        painter.setFont(font)
        texts = row_height >= MIN_TEXT_PX
        for row in range(lens.layers):
            layer = lens.layers - 1 - row
            first = cell_rect(row, 0)
            if not small or layer % 5 == 4 or layer == lens.layers - 1:
                painter.setPen(DIM)
                label = QRectF(0, first.top(), first.left() - 4, first.height())
                align = Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter
                painter.drawText(label, align, f"layer {layer + 1}")
            for column in range(min(COLUMNS, len(lens.token_ids[layer]))):
                rect = cell_rect(row, column).adjusted(1, 1, -1, -1)
                painter.fillRect(rect, cell_colour(lens.probs[layer][column]))
                if lens.token_ids[layer][column] == lens.token_id:
                    painter.setPen(CHOSEN)
                    painter.drawRect(rect)
                if texts:
                    painter.setPen(TEXT)
                    text = f"{quoted(lens.texts[layer][column])} {lens.probs[layer][column]:.0%}"
                    painter.drawText(rect, centre, text)
            rank = cell_rect(row, COLUMNS).adjusted(1, 1, -1, -1)
            painter.fillRect(rank, cell_colour(lens.chosen_probs[layer]))
            painter.setPen(TEXT)
            painter.drawText(rank, centre, f"#{lens.chosen_ranks[layer] + 1}")


class LayersPanel(StatePanel):
    """The logit lens of the selected (else the latest) step; see the module docstring."""

    lens_wanted = Signal(int)  # a step whose lens the panel needs: ask the engine
    watch_changed = Signal(bool)  # on screen or not: the engine keeps steps only while on

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, NEXT_TOKEN, parent)
        self.book = LensBook()
        self.sentence = QLabel()
        self.sentence.setWordWrap(True)
        self.grid = LensGrid()
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.sentence)
        layout.addWidget(self.grid, 1)
        self.pages = fill_with_pages(self, EMPTY_TEXT, content)
        self._drawn_book = -1
        self.shown_step: int | None = None
        self._shown_reply = 0
        self._asks = Throttle()  # `pending`: a step waits to be asked for
        self.lens_cost_s: float | None = None  # what the last lens took the engine
        self._cost_of: object = None  # the model (ModelInfo) that lens was of

    def wanted_step(self) -> int | None:
        """The selected step, else the latest (None before any token, or a prompt token)."""
        state = self._state
        if state.selected is not None:
            return state.selected_step
        return state.steps - 1 if state.steps else None

    def set_lens(self, ask: int, lens: LayerLens | None) -> None:
        """The engine's answer to an ask (GUI thread). A lens whose token is not the one this
        step chose belongs to a reply the engine began meanwhile: it counts as not kept."""
        if lens is not None:
            self.lens_cost_s, self._cost_of = lens.seconds, self._state.info
            if not self._chose(lens.step, lens.token_id):
                lens = None
        if self.book.answered(ask, lens):
            self.tracker.mark()

    def _chose(self, step: int, token_id: int) -> bool:
        chosen = self._state.chosen
        return 0 <= step < len(chosen) and chosen[step] == token_id

    def asked(self, ask: int | None, step: int) -> None:
        """The ask for `step` went out with id `ask` (None: no engine to ask)."""
        if ask is not None:
            self.book.asked(ask, step)

    def needs_redraw(self) -> bool:
        stale = self.tracker.stale or self.book.revision != self._drawn_book
        return stale or (self._asks.pending and self._ask_due())

    def redraw(self) -> None:
        self.book.follow(len(self._state.replies))
        step = self.wanted_step()
        self._asks.pending = self.book.needs_ask(step)
        if self._asks.pending and self._ask_due():
            assert step is not None  # needs_ask says no for None
            self.lens_wanted.emit(step)
            self._asks.drawn(self._ask_shape())
        self.tracker.drawn(self.tracker.snapshot())
        self._drawn_book = self.book.revision
        self._draw(step)

    def _ask_due(self) -> bool:
        state = self._state
        if state.explaining:
            return True
        if state.selected is None and self._reply_just_began():
            return False
        return self._asks.due(self.follow_interval(), self._ask_shape())

    def follow_interval(self) -> float:
        """Seconds between two asks for a running reply's latest step: LENS_SHARE of the
        model's time at the last lens's cost, no less than FOLLOW_FLOOR_S."""
        cost = self._lens_cost()
        return FOLLOW_INTERVAL_S if cost is None else max(FOLLOW_FLOOR_S, cost / LENS_SHARE)

    def _lens_cost(self) -> float | None:
        """What the last lens took the engine, if it was of the model loaded now."""
        return self.lens_cost_s if self._cost_of is self._state.info else None

    def _reply_running(self) -> bool:
        reply = self._state.reply
        return reply is not None and reply.finished is None and reply.error is None

    def _reply_just_began(self) -> bool:
        """Following a reply that has decoded for less than an interval: its first lens waits
        until it has (or until it ends). Asked at its first token, it held the reply's first
        steps up by a lens's product for a panel that follows at that rate anyway."""
        reply = self._state.reply
        return (
            self._reply_running() and reply is not None and reply.decode_s < self.follow_interval()
        )

    def _ask_shape(self) -> tuple[object, ...]:
        """What, changed, is asked for at once: the selection, the reply, and its end."""
        return (self._state.selected, self.book.reply, self._reply_running())

    def _draw(self, step: int | None) -> None:
        if step is None or self.book.reply != self._shown_reply:
            self.shown_step, self._shown_reply = None, self.book.reply
            self.pages.set_message(EMPTY_TEXT)
        if step is not None and self._state.selected is None and step not in self.book.lenses:
            # Following a running reply: an answer comes a step or more after the latest it
            # was asked for, so the newest one received is shown (its step named) meanwhile.
            received = self.book.latest(step)
            step = step if received is None else received
        lens = self.book.lenses.get(step) if step is not None else None
        if lens is None and step is not None and step in self.book.missing:
            self.pages.set_message(
                f"Step {step} was not kept: the engine records each layer's residual only"
                " while this panel is open. Send a message (or select a later step) to see it."
            )
        if lens is None:  # until the answer comes, the step shown before stays
            if self.shown_step is None or step in self.book.missing:
                self.pages.show_content(False)
            return
        self.shown_step = step
        self.sentence.setText(f"Step {step}: {lens_sentence(lens)}{self._following_note()}")
        self.grid.set_lens(lens)
        self.pages.show_content(True)

    def _following_note(self) -> str:
        """While it follows a running reply, how often and why no more often."""
        if self._state.selected is not None or not self._reply_running():
            return ""
        cost = self._lens_cost()
        if cost is None:
            return ""
        return (
            f"\nFollowing the reply: a new lens every {self.follow_interval():.1f} s, as each"
            f" holds the model up {cost * 1000:.0f} ms."
        )

    def showEvent(self, event: QShowEvent) -> None:
        super().showEvent(event)
        self.book.forget_missing()
        self.watch_changed.emit(True)

    def hideEvent(self, event: QHideEvent) -> None:
        super().hideEvent(event)
        self.watch_changed.emit(False)
