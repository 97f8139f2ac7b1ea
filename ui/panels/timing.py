"""Timing panel: where a reply's time goes, step by step and turn by turn."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QCheckBox, QLabel, QVBoxLayout, QWidget

from ui.panels.bar_chart import BarSet, TimelineChart, TurnsChart, format_duration
from ui.panels.empty import fill_with_pages
from ui.panels.key import key_label
from ui.panels.line_chart import LineChart, Series
from ui.panels.ranges import AxisLimit, decimate
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import StatePanel, Throttle
from ui.panels.state import TIMING, InternalsState, ReplyTiming
from ui.panels.state.explain import timing_line
from ui.panels.step_line import StepLine

WITH_CACHE = "with KV cache"
WITHOUT_CACHE = "without KV cache"

# (name, colour) of the phases on a reply's timeline bar, in the order they happen.
PHASES = (
    ("tokenize", (150, 150, 150)),
    ("prefill", (66, 133, 244)),
    ("first token", (251, 188, 5)),
    ("decode", (52, 168, 83)),
)
# Per-frame work must not grow with the conversation: a long chat made every frame of this
# panel cost several times more (a bar row and a tick label per turn). The timeline shows the latest
# replies; the per-turn chart keeps every turn but labels at most MAX_TURN_LABELS of them.
TIMELINE_REPLIES = 12
MAX_TURN_LABELS = 12
REUSED_BRUSH = (160, 160, 160)
# While a reply decodes, the timeline changes by its decode bar growing: it redraws at most
# this often (at once for a new reply, its end or a failure). Every frame, it was a third of
# the panel's repaints while the step-latency curve, the live view, changed.
TIMELINE_INTERVAL_S = 1.0

PROCESSED_BRUSH = (66, 133, 244)
TTFT_COLOUR = (217, 48, 37)

EMPTY_MESSAGE = (
    "<b>Timing</b><br>Where a reply's time goes. <i>Prefill</i> reads the whole prompt in one "
    "parallel pass: it ends with the first token (time to first token). <i>Decode</i> then "
    "makes one token per step, each step a pass over all the weights for a single token."
    "<br><br><i>Send a message to see its timeline, the latency of every decode step and, "
    "turn by turn, how much of the prompt the KV cache saved from being prefilled again.</i>"
)


def cache_label(use_cache: bool) -> str:
    """The legend label of a reply's step-latency curve for GenerationSettings.use_cache."""
    return WITH_CACHE if use_cache else WITHOUT_CACHE


def turn_ticks(replies: Sequence[ReplyTiming]) -> list[tuple[int, str]]:
    """Evenly spaced (index, turn) labels, at most MAX_TURN_LABELS, the latest always one."""
    step = max(math.ceil(len(replies) / MAX_TURN_LABELS), 1)
    return [(i, replies[i].turn) for i in range(len(replies) - 1, -1, -step)][::-1]


def phase_seconds(reply: ReplyTiming) -> tuple[float, float, float, float]:
    decode = reply.finished.decode_s if reply.finished is not None else reply.decode_s
    return reply.tokenize_s, reply.prefill_s, reply.first_token_extra_s, decode


def format_seconds(seconds: float | None) -> str:
    return "–" if seconds is None else format_duration(seconds)


def summary_html(reply: ReplyTiming | None, error: str | None = None) -> str:
    failed = f"<span style='color:#d93025'>failed: {html.escape(error)}</span>" if error else ""
    if reply is None:
        return failed or "No reply yet."
    parts = [
        f"<b>TTFT</b> {format_seconds(reply.ttft_s)} "
        f"(tokenize {format_seconds(reply.tokenize_s)} + first token "
        f"{format_seconds(reply.first_token_s)})",
        f"<b>prefill</b> {reply.processed_tokens} tokens at "
        f"{reply.prefill_tokens_per_s:,.0f} tok/s ({reply.reused_tokens} reused from the cache)",
    ]
    state = "final" if reply.finished is not None else "live"
    parts.append(
        f"<b>decode</b> {reply.decode_tokens_per_s:.1f} tok/s ({state}, "
        f"{len(reply.step_seconds)} steps in {format_seconds(reply.decode_s)})"
    )
    if failed:
        parts.append(failed)
    return "<br>".join(parts)


class TimingPanel(StatePanel):
    """Phase timeline per reply, live decode-step latency, and TTFT vs cache reuse per turn."""

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, TIMING, parent)
        self._legend_names: tuple[str, ...] = ()
        self._turns_drawn: tuple[object, ...] | None = None
        self._bars_drawn: dict[str, tuple[np.ndarray, ...]] = {}  # per phase: x0, y, width
        # When the timeline was drawn, and which replies it showed (see _timeline_shape).
        self._timeline_throttle = Throttle()
        # Ranges set when the data outgrows them: a frame that only grows a bar or a curve
        # draws no axis again. A new chat's first turn like the last chat's keeps its axes.
        self._timeline_x, self._steps_x, self._steps_y = AxisLimit(), AxisLimit(), AxisLimit()
        self._turns_y, self._ttft_y = AxisLimit(), AxisLimit()
        self.numbers = QLabel(summary_html(None))
        self.numbers.setTextFormat(Qt.TextFormat.RichText)
        self.numbers.setWordWrap(True)
        self.compare = QCheckBox("Compare with the previous reply")
        self.compare.toggled.connect(self._on_compare)
        content = QWidget()
        layout = QVBoxLayout(content)
        layout.setContentsMargins(0, 0, 0, 0)
        self.step_line = StepLine()
        layout.addWidget(self.step_line)
        layout.addWidget(ReadoutBox(self.numbers))
        timeline = self._build_timeline()
        layout.addWidget(self.phase_key)
        layout.addWidget(timeline, 2)
        layout.addWidget(self.compare)
        layout.addWidget(self._build_steps(), 3)
        layout.addWidget(self._build_turns(), 3)
        self.pages = fill_with_pages(self, EMPTY_MESSAGE, content)

    # -- construction ------------------------------------------------------------------------

    def _build_timeline(self) -> TimelineChart:
        self.timeline = TimelineChart(f"Reply timeline (the latest {TIMELINE_REPLIES})")
        self.timeline.setMinimumHeight(90)
        self.phase_bars: dict[str, BarSet] = {
            name: self.timeline.add_bars(name, colour) for name, colour in PHASES
        }
        self.phase_key = key_label([(colour, name) for name, colour in PHASES])
        return self.timeline

    def _build_steps(self) -> LineChart:
        self.steps_plot = LineChart(
            "Decode step latency", "generated token", "latency", ((1e-3, "ms"), (1.0, "s"))
        )
        self.steps_plot.setMinimumHeight(120)
        self.step_curve = self.steps_plot.add_series(Series((52, 168, 83)))
        self.previous_curve = self.steps_plot.add_series(Series((160, 160, 160), dashed=True))
        self.previous_curve.setVisible(False)
        return self.steps_plot

    def _build_turns(self) -> TurnsChart:
        self.turns_plot = TurnsChart(
            (
                ("Prompt per turn: ", (200, 200, 200)),
                ("reused from the cache", REUSED_BRUSH),
                (", ", (200, 200, 200)),
                ("prefilled", PROCESSED_BRUSH),
                (", ", (200, 200, 200)),
                ("TTFT", TTFT_COLOUR),
            ),
            "prompt tokens",
            "TTFT",
            TTFT_COLOUR,
        )
        self.turns_plot.setToolTip(
            "Grey: prompt tokens reused from the KV cache (not recomputed). Blue: tokens "
            "prefilled now. Later turns only prefill what is new, so their TTFT stays short."
        )
        self.turns_plot.describe_turn = self._describe_turn
        self.turns_plot.setMinimumHeight(120)
        self.reused_bars = self.turns_plot.add_bars(REUSED_BRUSH)
        self.processed_bars = self.turns_plot.add_bars(PROCESSED_BRUSH)
        self.ttft_curve = self.turns_plot  # its points: getData() as a curve's
        return self.turns_plot

    def _describe_turn(self, index: int) -> str:
        replies = self._state.replies
        if not 0 <= index < len(replies):
            return ""
        reply = replies[index]
        return (
            f"{reply.turn}: {reply.reused_tokens + reply.processed_tokens} prompt tokens, "
            f"{reply.reused_tokens} reused from the cache, {reply.processed_tokens} prefilled; "
            f"TTFT {format_seconds(reply.ttft_s)}"
        )

    # -- public ----------------------------------------------------------------------------

    def compare_with_previous(self, enabled: bool) -> None:
        """Overlay the previous reply's step-latency curve (with vs without the KV cache)."""
        self.compare.setChecked(enabled)

    def _on_compare(self, _checked: bool) -> None:
        self.tracker.mark()

    def needs_redraw(self) -> bool:
        return self.tracker.stale or (self._timeline_throttle.pending and self._timeline_due())

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        reply = self._state.reply
        if self.tracker.stale:
            self.pages.show_content(reply is not None or self._state.last_error is not None)
            self.numbers.setText(summary_html(reply, self._state.last_error))
            self._draw_steps(reply)
            self._draw_turns()
            self._draw_selected_step()
        self._timeline_throttle.pending = True
        if self._timeline_due():
            self._draw_timeline()
            self._timeline_throttle.drawn(self._timeline_shape())
        self.tracker.drawn(revisions)

    def _timeline_due(self) -> bool:
        # While a teacher steps, every step shows at once: there is time to draw it
        stepping = self._state.explaining
        return stepping or self._timeline_throttle.due(TIMELINE_INTERVAL_S, self._timeline_shape())

    def _timeline_shape(self) -> tuple[object, ...]:
        """What, changed, redraws the timeline at once: the replies, each one's end."""
        replies = self._state.replies[-TIMELINE_REPLIES:]
        return tuple((id(r), r.finished is not None, r.error) for r in replies)

    # -- drawing ---------------------------------------------------------------------------

    def _draw_timeline(self) -> None:
        replies = self._state.replies[-TIMELINE_REPLIES:]
        if not replies and self.pages.empty:  # a new chat: hidden until its first reply
            return
        phases = np.array([phase_seconds(r) for r in replies], dtype=np.float64).reshape(-1, 4)
        starts = np.cumsum(phases, axis=1) - phases
        rows = np.arange(len(replies), dtype=np.float64)
        for column, (name, _colour) in enumerate(PHASES):
            bars = (starts[:, column], rows, phases[:, column])
            drawn = self._bars_drawn.get(name)
            # While a reply decodes only its decode bar grows: the other bars keep their items
            # (a new setOpts draws a bar's picture again and repaints it).
            if drawn is None or not all(map(np.array_equal, bars, drawn)):
                self._bars_drawn[name] = bars
                self.phase_bars[name].setOpts(x0=bars[0], y=bars[1], width=bars[2])
        total = float(phases.sum(axis=1).max()) if len(replies) else 0.0
        self._timeline_x.update(total)
        self.timeline.set_x_limit(self._timeline_x.limit)
        self.timeline.set_rows([r.turn for r in replies])

    def _draw_selected_step(self) -> None:
        state = self._state
        shown = state.showing_step
        self.step_line.say(timing_line(state), shown)
        step = state.selected_step
        self.steps_plot.set_marker(float(step) if shown and step else None)

    def _draw_steps(self, reply: ReplyTiming | None) -> None:
        pixels = self.steps_plot.plot_rect().width()
        if reply is None:
            self.step_curve.setData([], [])
        else:
            self.step_curve.setData(
                *decimate(reply.steps.view(), reply.step_seconds.view(), pixels)
            )
        previous = self._state.previous
        show_previous = self.compare.isChecked() and previous is not None
        if show_previous and previous is not None:
            self.previous_curve.setData(
                *decimate(previous.steps.view(), previous.step_seconds.view(), pixels)
            )
        self.previous_curve.setVisible(show_previous)
        self._update_legend(reply, previous if show_previous else None)
        shown = [r for r in (reply, previous if show_previous else None) if r is not None]
        last_step = max((float(r.steps.last()) for r in shown if len(r.steps)), default=0.0)
        slowest = max(
            (float(r.step_seconds.view().max()) for r in shown if len(r.steps)), default=0.0
        )
        self._steps_x.update(last_step)
        self._steps_y.update(slowest)
        self.steps_plot.set_range(self._steps_x.limit, self._steps_y.limit)

    def _update_legend(self, reply: ReplyTiming | None, previous: ReplyTiming | None) -> None:
        current = (reply.curve_label if reply else "") or "this reply"
        names: tuple[str, ...] = (current,)
        if previous is not None:
            before = previous.curve_label or "previous reply"
            names += (f"{before} (previous)" if before == current else before,)
        if names == self._legend_names:
            return
        self.step_curve.name = names[0]
        self.previous_curve.name = names[1] if len(names) > 1 else ""
        self.steps_plot.update()
        self._legend_names = names

    def _draw_turns(self) -> None:
        replies = self._state.replies
        if not replies and self.pages.empty:  # a new chat: hidden until its first reply
            return
        # Per-turn numbers change a few times per reply: leave the chart alone in between.
        summary = tuple((r.turn, r.reused_tokens, r.processed_tokens, r.ttft_s) for r in replies)
        if summary == self._turns_drawn:
            return
        self._turns_drawn = summary
        turns = np.arange(len(replies), dtype=np.float64)
        reused = np.array([r.reused_tokens for r in replies], dtype=np.float64)
        processed = np.array([r.processed_tokens for r in replies], dtype=np.float64)
        ttft = np.array(
            [np.nan if r.ttft_s is None else r.ttft_s for r in replies], dtype=np.float64
        )
        self.reused_bars.setOpts(x=turns, y0=np.zeros_like(turns), height=reused)
        self.processed_bars.setOpts(x=turns, y0=reused, height=processed)
        finite = np.isfinite(ttft)  # a reply that failed before its first token has none
        self.turns_plot.set_points(turns[finite], ttft[finite])
        self._turns_y.update(float((reused + processed).max()) if len(replies) else 0.0)
        if finite.any():
            self._ttft_y.update(float(ttft[finite].max()))
        self.turns_plot.set_axes(
            len(replies), self._turns_y.limit, self._ttft_y.limit or 1.0, turn_ticks(replies)
        )
