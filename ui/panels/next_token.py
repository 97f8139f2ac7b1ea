"""Next-token panel: the top-k candidates of a step, before and after the sampling settings."""

from __future__ import annotations

from PySide6.QtCore import Qt, QUrl
from PySide6.QtGui import QFontMetrics, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QSlider,
    QSpinBox,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from engine.events import Candidate
from ui.panels.candidates import CandidateChart, CandidateRow
from ui.panels.empty import fill_with_pages
from ui.panels.key import key_label
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import StatePanel
from ui.panels.state import NEXT_TOKEN, InternalsState
from ui.panels.step_line import StepLine

PROB_BRUSH = (66, 133, 244)
SAMPLED_BRUSH = (251, 188, 5)
CHOSEN_PROB_BRUSH = (217, 48, 37)
CHOSEN_SAMPLED_BRUSH = (244, 143, 177)
# The strip keeps the latest tokens only: appending to one paragraph lays all of it out again,
# so an unbounded strip costs more every frame as a reply grows. Its few lines show the last
# hundred tokens or so; the slider reaches all.
STRIP_TOKENS = 128
# The candidates' labels keep one width: sized to them, the bars would move on every token.
# Longer labels are cut with an ellipsis.
LABEL_CHARACTERS = 16

EMPTY_MESSAGE = (
    "<b>Next token</b><br>At every step the model gives each token of its vocabulary a "
    "probability; the sampler then draws one. The bars will show the top candidates, as the "
    "model scored them and after temperature, top-k and top-p.<br><br><i>Send a message, "
    "then click any token of the reply to see the step that chose it.</i>"
)


def token_label(text: str) -> str:
    shown = repr(text)[1:-1]
    return shown if shown.strip() else repr(text)


def axis_label(text: str) -> str:
    """A candidate's label on the fixed-width axis: at most LABEL_CHARACTERS characters."""
    return text if len(text) <= LABEL_CHARACTERS else text[: LABEL_CHARACTERS - 1] + "…"


class NextTokenPanel(StatePanel):
    """A horizontal bar chart of one step's candidates; follows the latest step by default."""

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, NEXT_TOKEN, parent)
        self._step = -1
        self._bar_count = -1
        self.follow = QCheckBox("follow the latest token")
        self.follow.setChecked(True)
        self.follow.toggled.connect(lambda _on: self.tracker.mark())
        self.slider = QSlider(Qt.Orientation.Horizontal)
        self.spin = QSpinBox()
        # The range grows every token; a spin box sized to it asks the panel for a new layout
        # each time, every frame. Fixed at the width of a long reply's step, it never does.
        self.spin.setRange(0, 999_999)
        self.spin.setFixedSize(self.spin.sizeHint())
        for widget in (self.slider, self.spin):
            widget.setRange(0, 0)
            widget.valueChanged.connect(self._on_browse)
        self.summary = QLabel("No token yet.")
        self.summary.setWordWrap(True)
        # The reply as its tokens: click one to see the candidates of the step that chose it.
        self.tokens = QTextBrowser()
        self.tokens.setOpenLinks(False)
        self.tokens.setMaximumHeight(90)
        self.tokens.setPlaceholderText("The reply's tokens appear here; click one.")
        self.tokens.anchorClicked.connect(self._on_token_clicked)
        self._link_base = QTextCharFormat()
        self._link_base.setAnchor(True)
        self._link_base.setForeground(self.palette().link())
        self._tokens_shown = 0
        self._strip_start = 0  # the first step in the strip
        self._strip_reply: object | None = None  # the reply whose tokens the strip shows
        typical = "▶ " + "n" * (LABEL_CHARACTERS - 2)
        self.chart = CandidateChart(
            "Next-token candidates",
            "probability",
            QFontMetrics(self.font()).horizontalAdvance(typical) + 8,
            (PROB_BRUSH, SAMPLED_BRUSH, CHOSEN_PROB_BRUSH, CHOSEN_SAMPLED_BRUSH),
        )
        # The key sits above the chart: inside it, a legend covered the longest bars.
        self.key = key_label(
            (
                (PROB_BRUSH, "model probability"),
                (SAMPLED_BRUSH, "after temperature / top-k / top-p"),
                (CHOSEN_PROB_BRUSH, "the token chosen"),
            )
        )
        browse = QHBoxLayout()
        browse.addWidget(QLabel("Step:"))
        browse.addWidget(self.slider, 1)
        browse.addWidget(self.spin)
        browse.addWidget(self.follow)
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(browse)
        self.step_line = StepLine()
        layout.addWidget(self.step_line)
        self.readout = ReadoutBox(self.summary)
        layout.addWidget(self.readout)
        layout.addWidget(self.tokens)
        layout.addWidget(self.key)
        layout.addWidget(self.chart, 1)
        self.pages = fill_with_pages(self, EMPTY_MESSAGE, content)

    # -- public ----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step shown (-1 before the first token)."""
        return self._step

    def show_step(self, index: int) -> None:
        """Show one token's candidates (e.g. a token clicked in the reply); stops following."""
        self.follow.setChecked(False)
        self._set_browse(index)
        self.tracker.mark()

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        steps = self._state.steps
        self.pages.show_content(steps > 0)
        for widget in (self.slider, self.spin):
            widget.blockSignals(True)
            widget.setRange(0, max(steps - 1, 0))
            widget.blockSignals(False)
        self._append_tokens(steps)
        selected = self._state.step_at(self._state.selected)
        if selected is not None and selected != self.spin.value():  # chosen in another panel
            self.follow.setChecked(False)
            self._set_browse(selected)
        if self.follow.isChecked():
            self._set_browse(steps - 1)
        step = min(self.spin.value(), steps - 1)
        self._draw_step(step)
        self.step_line.say(self.summary.text(), self._state.showing_step and step >= 0)
        # the step's sentence once: in the step line while it shows, else in the readout
        self.readout.setHidden(self.step_line.isVisibleTo(self))
        self.tracker.drawn(revisions)

    # -- internals -------------------------------------------------------------------------

    def _append_tokens(self, steps: int) -> None:
        """Add the tokens chosen since the last frame (a new reply starts the strip over).

        Past 2 x STRIP_TOKENS the strip starts again from the latest STRIP_TOKENS.
        """
        reply = self._state.reply
        if reply is not self._strip_reply or steps < self._tokens_shown:
            self._restart_strip(0)
            self._strip_reply = reply
        if steps - self._strip_start > 2 * STRIP_TOKENS:
            self._restart_strip(steps - STRIP_TOKENS)
        if steps == self._tokens_shown:
            return
        cursor = self.tokens.textCursor()
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.beginEditBlock()  # one layout of the strip for all the frame's tokens
        for step in range(self._tokens_shown, steps):
            cursor.insertText(self._piece(step), self._link_format(step))
        cursor.endEditBlock()
        self._tokens_shown = steps

    def _restart_strip(self, start: int) -> None:
        self.tokens.clear()
        self._strip_start = self._tokens_shown = start

    def _piece(self, step: int) -> str:
        """A token as the strip shows it, with a zero-width space after it: a line may break
        between any two tokens."""
        return self._state.token_text(self._state.prompt_tokens + step) + "\u200b"

    def _link_format(self, step: int) -> QTextCharFormat:
        """A link to `step`, as plain text with a character format: inserting HTML parsed
        every fragment again, every frame (its leading space needed pre-wrap to survive)."""
        link = QTextCharFormat(self._link_base)
        link.setAnchorHref(f"step:{step}")
        return link

    def _on_token_clicked(self, url: QUrl) -> None:
        """A token of the reply selects its step in every panel."""
        step = int(url.toString().removeprefix("step:"))
        self.show_step(step)
        self._state.select(self._state.prompt_tokens + step)

    def _set_browse(self, index: int) -> None:
        for widget in (self.slider, self.spin):
            widget.blockSignals(True)
            widget.setValue(max(index, 0))
            widget.blockSignals(False)

    def _on_browse(self, value: int) -> None:
        self.follow.setChecked(False)
        self._set_browse(value)
        self.tracker.mark()

    def _draw_step(self, step: int) -> None:
        self._step = step
        if step < 0:
            self._set_bars(())
            self.summary.setText("No token yet.")
            return
        candidates = self._state.top_k[step]
        chosen = self._state.chosen[step]
        self._set_bars(candidates, chosen)
        self.summary.setText(self._summary(step, candidates, chosen))

    def _set_bars(self, candidates: tuple[Candidate, ...], chosen: int | None = None) -> None:
        rows = tuple(
            CandidateRow(
                axis_label(("▶ " if c.token_id == chosen else "") + token_label(c.text)),
                c.prob,
                c.sampled_prob,
                c.token_id == chosen,
            )
            for c in candidates
        )
        self.chart.set_rows(rows)
        if len(rows) != self._bar_count:  # a row per candidate at least a line of text high
            self._bar_count = len(rows)
            self.chart.setMinimumHeight(self.chart.minimum_height_for(len(rows)))

    def _summary(self, step: int, candidates: tuple[Candidate, ...], chosen: int) -> str:
        piece = self._state.token_text(self._state.prompt_tokens + step)
        match = next((c for c in candidates if c.token_id == chosen), None)
        if not candidates:
            return f"Step {step}: chose '{token_label(piece)}' (no candidates recorded)."
        if match is None:
            return (
                f"Step {step}: chose '{token_label(piece)}' (id {chosen}), which is not among "
                f"the top {len(candidates)} shown."
            )
        rank = candidates.index(match) + 1
        return (
            f"Step {step}: chose '{token_label(piece)}', candidate #{rank}: model probability "
            f"{match.prob:.1%}, after sampling settings {match.sampled_prob:.1%}."
        )
