"""Panels redraw only when they are on screen and their data changed, and catch up once shown;
readouts and streamed chat text do not lay out or draw more than they must.

The redraw timer is stopped: each `tick` below is what one timeout of it does.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from PySide6.QtCore import QEvent, QObject, QPointF, QRectF, Qt, QTimer
from PySide6.QtGui import QFontMetricsF
from PySide6.QtWidgets import (
    QApplication,
    QLabel,
    QMainWindow,
    QProgressBar,
    QStyle,
    QStyleOptionSlider,
    QVBoxLayout,
    QWidget,
)

from engine.events import Tally, Token
from engine.settings import GenerationSettings
from tests.ui.test_panels import HEADS, causal, model_info, prefill, token
from ui import turns
from ui.chat_view import SLOWEST_STREAM_FRAME_MS, STREAM_FRAME_MS, ChatView
from ui.conversation import Conversation
from ui.panels import docks, pooled_rows, redraw
from ui.panels.docks import (
    FRAME_MS,
    SLOWEST_FRAME_MS,
    WINDOW_CPU_SHARE,
    InternalsView,
    build_docks,
    frame_interval,
    shown,
)
from ui.panels.kv_cache import set_bar
from ui.panels.readout import ReadoutBox
from ui.panels.state import AttentionRows

PANELS = ("timing", "kv_cache", "attention", "next_token")


class Docked:
    """A main window with the four docks as the app lays them out, counting redraws."""

    def __init__(self, qtbot) -> None:
        self.window = QMainWindow()
        qtbot.addWidget(self.window)
        self.view: InternalsView = build_docks(self.window)
        self.view.timer.stop()
        self.counts = dict.fromkeys(PANELS, 0)
        for name in PANELS:
            self._count(name)
        self.window.resize(1200, 800)
        self.window.show()
        qtbot.waitExposed(self.window)
        self.view.set_model(model_info())
        self.view.set_watched_layers((0, 1))
        # Showing the docks posted a frame each (zero-time single shots): run them now, or one
        # lands inside a test's own frames on a loaded machine (it drew a second frame there).
        QApplication.processEvents()

    def _count(self, name: str) -> None:
        panel = getattr(self.view, name)
        redraw = panel.redraw

        def counted() -> None:
            self.counts[name] += 1
            redraw()

        panel.redraw = counted

    def tick(self, times: int = 1) -> dict[str, int]:
        """Run the timer's slot `times` times; the redraws each panel made meanwhile."""
        before = dict(self.counts)
        for _ in range(times):
            self.view.redraw()
        return {name: self.counts[name] - before[name] for name in PANELS}


@pytest.fixture
def docked(qtbot):
    return Docked(qtbot)


@pytest.fixture
def rng():
    return np.random.default_rng(3)


def test_tabbed_behind_panels_wait_and_draw_once_when_raised(qtbot, docked, rng):
    view = docked.view
    assert not shown(view.kv_cache) and not shown(view.next_token)  # tabbed behind
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    assert docked.tick(3) == {"timing": 1, "kv_cache": 0, "attention": 1, "next_token": 0}
    assert view.kv_cache.needs_redraw() and view.next_token.needs_redraw()

    view.docks["kv_cache"].raise_()
    qtbot.waitUntil(lambda: shown(view.kv_cache))
    qtbot.waitUntil(lambda: docked.counts["kv_cache"] == 1)  # at once, not a tick later
    assert docked.tick(3)["kv_cache"] == 0  # once only
    _x, y = view.kv_cache.curve.getData()
    assert y[-1] == view.state.kv_bytes.last()  # the latest data, not the frame it missed
    assert not shown(view.timing)  # now the timing panel is behind: it waits in turn
    view.ingest(token(rng, 1))
    assert docked.tick(2) == {"timing": 0, "kv_cache": 1, "attention": 1, "next_token": 0}


def test_a_closed_panel_does_not_redraw_until_shown_again(qtbot, docked, rng):
    view = docked.view
    view.ingest(prefill(rng))
    docked.tick()
    dock = view.docks["attention"]
    dock.close()
    qtbot.waitUntil(lambda: not shown(view.attention))
    for index in range(4):
        view.ingest(token(rng, index))
    assert docked.tick(3)["attention"] == 0
    before = docked.counts["attention"]
    dock.show()
    qtbot.waitUntil(lambda: shown(view.attention))
    docked.tick(3)
    assert docked.counts["attention"] == before + 1  # once on showing
    rows = view.state.attention[view.attention.selected_layer]
    assert view.attention.head_tile(0).shape == (rows.rows, rows.keys)  # the latest rows


def test_a_minimised_window_redraws_nothing_until_restored(qtbot, docked, rng):
    view = docked.view
    view.docks["next_token"].setFloating(True)  # a window of its own, owned by the main one
    view.ingest(prefill(rng))
    qtbot.waitUntil(lambda: shown(view.next_token))
    docked.tick()
    docked.window.showMinimized()
    qtbot.waitUntil(docked.window.isMinimized)
    assert not any(shown(getattr(view, name)) for name in PANELS)
    for index in range(3):
        view.ingest(token(rng, index))
    assert docked.tick(3) == dict.fromkeys(PANELS, 0)
    docked.window.showNormal()
    qtbot.waitUntil(lambda: not docked.window.isMinimized())
    qtbot.waitUntil(lambda: shown(view.timing))
    drawn = docked.tick(3)
    assert drawn["timing"] == drawn["attention"] == drawn["next_token"] == 1


def test_the_timer_sleeps_in_a_minimised_window_and_draws_when_it_is_restored(
    qtbot, docked, rng, monkeypatch
):
    """Minimised mid-reply, the panels need drawing but none can be seen: the timer sleeps
    (it ticked 30 times a second until the window came back) and restoring wakes it."""
    view = docked.view
    monkeypatch.setattr(docks, "SLEEP_AFTER_S", 0.0)
    view.ingest_many([prefill(rng), token(rng, 0)])
    view.timer.start()  # as the window runs it
    qtbot.waitUntil(lambda: not view.timing.needs_redraw(), timeout=3000)
    docked.window.showMinimized()
    qtbot.waitUntil(docked.window.isMinimized)
    view.ingest_many([token(rng, 1)])
    assert view.timing.needs_redraw()
    qtbot.waitUntil(lambda: view.asleep, timeout=3000)
    view.ingest_many([token(rng, 2)])  # more data, still nothing on screen: asleep
    assert view.asleep and view.timing.needs_redraw()
    docked.window.showNormal()
    qtbot.waitUntil(lambda: not view.timing.needs_redraw(), timeout=3000)
    _x, steps = view.timing.step_curve.getData()
    assert len(steps) == 2  # the two decode steps that arrived while minimised


def test_a_panel_whose_data_did_not_change_does_not_redraw(docked, rng):
    view = docked.view
    view.docks["kv_cache"].setFloating(True)  # all four on screen
    view.docks["next_token"].setFloating(True)
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    assert docked.tick() == dict.fromkeys(PANELS, 1)
    assert docked.tick(5) == dict.fromkeys(PANELS, 0)  # nothing new: nothing redrawn
    # A token without attention rows changes timing, KV and next token, not the heatmaps.
    plain = token(rng, 1)
    view.ingest(
        Token(**{**{f: getattr(plain, f) for f in plain.__dataclass_fields__}, "attention": {}})
    )
    assert docked.tick(2) == {"timing": 1, "kv_cache": 1, "attention": 0, "next_token": 1}
    view.attention.per_head_scale.toggle()  # a change on the panel itself
    assert docked.tick(2) == {"timing": 0, "kv_cache": 0, "attention": 1, "next_token": 0}


def test_the_window_keeps_to_a_hundredth_share_where_it_shares_the_engines_cores():
    assert docks.window_cpu_share(2) == docks.window_cpu_share(1) == 0.04
    assert docks.window_cpu_share(None) == 0.04  # unknown: as on the smallest machine
    assert docks.window_cpu_share(8) > 0.04  # the engine leaves the window a core there


def test_frame_interval_backs_off_when_the_window_process_is_busy_and_recovers():
    assert frame_interval(FRAME_MS, WINDOW_CPU_SHARE * 1.1) == math.ceil(FRAME_MS * 1.5)
    # Three times over budget: three times longer at once, not 1.5x a second for seconds.
    assert frame_interval(50, WINDOW_CPU_SHARE * 3) in (150, 151)  # (float rounding)
    assert frame_interval(SLOWEST_FRAME_MS, 1.0) == SLOWEST_FRAME_MS  # never slower
    assert frame_interval(100, 1.0) == SLOWEST_FRAME_MS
    assert frame_interval(100, WINDOW_CPU_SHARE * 0.8) == 100  # near the budget: settled
    assert frame_interval(100, 0.0) == 50
    assert frame_interval(FRAME_MS, 0.0) == FRAME_MS  # never faster than about 30 Hz


def governed(monkeypatch) -> tuple[InternalsView, dict[str, float]]:
    """A view whose frame governor reads `clock` (wall and process CPU seconds), its timer
    stopped: the test ticks it."""
    view = InternalsView()
    view.timer.stop()
    clock = {"wall": 100.0, "cpu": 10.0}
    monkeypatch.setattr(docks.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(docks.time, "process_time", lambda: clock["cpu"])
    view._window = (clock["wall"], clock["cpu"])
    return view, clock


def test_the_redraw_timer_slows_while_the_window_process_is_busy(qtbot, monkeypatch):
    view, clock = governed(monkeypatch)
    assert view.timer.interval() == FRAME_MS  # idle: a click draws at once
    view._drawn(1)  # the first frame of the first reply: a moderate rate until one is found
    assert view.timer.interval() == docks.FIRST_BUSY_FRAME_MS
    intervals = []
    for second in range(12):
        busy = second < 6  # six seconds at 0.6 of a core drawing frames, then six idle ones
        clock["wall"] += 1.0
        clock["cpu"] += 0.6 if busy else 0.01
        if busy:
            view.ingest_many([])  # a reply's events arrive
            view._drawn(4)  # as _draw_queued counts the panels it redrew
            view.frames += 2  # and the frames they were drawn in
        view._tick()
        intervals.append(view.timer.interval())
    assert intervals[:6] == sorted(intervals[:6]) and intervals[5] == SLOWEST_FRAME_MS
    assert intervals[1] == SLOWEST_FRAME_MS  # five times over budget: there in two windows
    assert intervals[-1] == FRAME_MS  # idle: a click on a panel draws at once
    # The rate found while drawing is kept: the next reply's first frame goes back to it
    # instead of spending its first second at 30 Hz.
    assert view.busy_interval == SLOWEST_FRAME_MS
    view._drawn(4)
    assert view.timer.interval() == SLOWEST_FRAME_MS
    # Redraws on an idle thread without a reply (a new chat clearing the panels) do not speed
    # the rate up: they say nothing of what streaming frames cost.
    view._drawn(8)
    view.frames += 2
    clock["wall"] += 1.0
    clock["cpu"] += 0.01
    view._tick()
    assert view.busy_interval == SLOWEST_FRAME_MS
    # A second of a reply's frames (two, all its interval allows) well under budget speeds
    # them up.
    view.ingest_many([])
    view._drawn(8)
    view.frames += 2
    clock["wall"] += 1.0
    clock["cpu"] += 0.01
    view._tick()
    assert view.timer.interval() == SLOWEST_FRAME_MS // 2


def test_the_wait_for_a_prefill_does_not_count_as_cheap_frames(qtbot, monkeypatch):
    view, clock = governed(monkeypatch)
    view.busy_interval = 200
    view._drawn(1)
    clock["wall"] += 0.9  # the engine prefills; the window idles
    view.ingest_many([])  # the prompt's events, then the reply's tokens
    for _ in range(4):  # streaming at 0.3 of a core, drawing every frame its interval allows
        clock["wall"] += 0.25
        clock["cpu"] += 0.075
        view._drawn(4)
        view.frames += 1
        view.ingest_many([])
        view._tick()
    # Measured from the first events: over budget, so slower. Counted from before the
    # prefill, the same second looked like a third of that and sped the frames up.
    assert view.busy_interval > 200


def test_a_frame_yields_to_the_event_loop_between_expensive_panels(qtbot, docked, rng, monkeypatch):
    view = docked.view
    for name in PANELS:
        view.docks[name].setFloating(True)  # all four on screen
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    qtbot.waitUntil(lambda: all(shown(getattr(view, name)) for name in PANELS))
    frames_asked_for_are_done(qtbot, view)
    docked.tick()  # draw everything once: the frame below starts from a clean slate
    view.ingest(token(rng, 1))
    monkeypatch.setattr(docks, "FRAME_SLICE_S", 0.0)  # every panel is over the slice
    before = dict(docked.counts)
    view._tick()
    assert sum(docked.counts[n] - before[n] for n in PANELS) == 1  # one panel, then yield
    qtbot.waitUntil(lambda: all(docked.counts[n] - before[n] == 1 for n in PANELS))
    view._tick()  # nothing changed since: nothing drawn
    assert all(docked.counts[n] - before[n] == 1 for n in PANELS)


def test_the_timer_sleeps_with_nothing_on_screen_to_draw_and_wakes_when_there_is(
    qtbot, docked, rng, monkeypatch
):
    """Idle, or with every dock closed, the panel timer does not tick at all; data for a panel
    on screen, a dock shown or a panel's own choice starts it again."""
    view = docked.view
    monkeypatch.setattr(docks, "SLEEP_AFTER_S", 0.0)
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    view.timer.start()  # as the window runs it
    # It draws the panels on screen, then sleeps: those tabbed behind wait to be raised.
    qtbot.waitUntil(lambda: view.asleep, timeout=3000)
    assert not view.timer.isActive() and docked.counts["timing"] >= 1
    assert view.kv_cache.needs_redraw() and not view.timing.needs_redraw()

    drawn = docked.counts["timing"]
    view.ingest_many([token(rng, 1)])  # for the timing panel, on screen: awake, and drawn
    assert view.timer.isActive() and not view.asleep
    qtbot.waitUntil(lambda: docked.counts["timing"] > drawn and view.asleep, timeout=3000)

    for dock in view.docks.values():
        dock.close()
    qtbot.waitUntil(lambda: view.asleep, timeout=3000)
    sleeps = view.sleeps
    view.ingest_many([token(rng, 2)])  # nothing on screen to draw it: it sleeps on
    assert view.asleep and not view.timer.isActive()

    view.docks["kv_cache"].show()  # shown: awake, and drawn with the latest data
    qtbot.waitUntil(lambda: view.timer.isActive() or view.sleeps > sleeps, timeout=3000)
    qtbot.waitUntil(lambda: not view.kv_cache.needs_redraw() and view.asleep, timeout=3000)
    _x, y = view.kv_cache.curve.getData()
    assert y[-1] == view.state.kv_bytes.last()

    view.kv_cache.tracker.mark()  # a choice on the panel itself (another view of the cache)
    assert view.timer.isActive() and not view.asleep


def test_a_timer_stopped_by_its_owner_is_not_woken(qtbot, docked, rng):
    """Tests drive frames by hand with the timer stopped: data and shown docks leave it so."""
    view = docked.view  # its timer stopped, as Docked does
    view.ingest_many([prefill(rng), token(rng, 0)])
    view.docks["kv_cache"].raise_()
    view.kv_cache.tracker.mark()
    qtbot.wait(50)
    assert not view.timer.isActive() and not view.asleep and view.sleeps == 0


class _Events(QObject):
    """Counts the events of one type a widget receives (layout requests: its layout was
    invalidated; paints)."""

    def __init__(self, widget: QWidget, kind: QEvent.Type) -> None:
        super().__init__(widget)
        self.kind, self.count = kind, 0
        widget.installEventFilter(self)

    def eventFilter(self, _watched: QObject, event: QEvent) -> bool:
        if event.type() == self.kind:
            self.count += 1
        return False


def test_a_readout_relays_out_its_panel_only_when_its_height_changes(qtbot):
    panel = QWidget()
    qtbot.addWidget(panel)
    label = QLabel("Step 1: chose 'a', candidate #1.")
    label.setWordWrap(True)
    box = ReadoutBox(label)
    layout = QVBoxLayout(panel)
    layout.addWidget(box)
    layout.addWidget(QLabel("below"), 1)
    panel.resize(300, 200)
    panel.show()
    qtbot.waitExposed(panel)
    QApplication.processEvents()
    one_line = box.height()
    assert one_line == label.heightForWidth(box.width()) and label.geometry() == box.rect()
    requests = _Events(panel, QEvent.Type.LayoutRequest)
    for step in range(2, 30):  # one line each: the panel is not laid out again
        label.setText(f"Step {step}: chose 'b', candidate #2.")
        QApplication.processEvents()
    assert requests.count == 0 and box.height() == one_line
    label.setText(" ".join(["a long explanation that wraps"] * 8))
    QApplication.processEvents()
    QApplication.processEvents()
    assert requests.count >= 1
    assert box.height() == label.heightForWidth(box.width()) > one_line
    assert label.geometry() == box.rect()  # every line is shown


def test_streamed_chat_text_is_drawn_once_per_stream_frame(qtbot):
    conversation = Conversation()
    view = ChatView(conversation)
    qtbot.addWidget(view)
    conversation.add_user("Hi", GenerationSettings(), None)
    conversation.start_reply(GenerationSettings(), None)
    edits: list[int] = []
    view.document().contentsChange.connect(lambda _at, _removed, added: edits.append(added))
    chunks = iter(enumerate(("Hel", "lo ", "world", "!", " more")))

    def stream(count: int) -> None:
        for index, text in (next(chunks) for _ in range(count)):
            conversation.apply(Token(index, index, text, text, 0.01, 0, ()))

    stream(3)
    # The first text is drawn at once; what follows within a stream frame waits for it.
    assert "Hel" in view.document().toPlainText() and edits == [len("Hel")]
    assert "Hello" not in view.document().toPlainText()
    assert view.reply_text() == "Hello world"  # but kept
    qtbot.waitUntil(lambda: "Hello world" in view.document().toPlainText(), timeout=2000)
    assert edits == [len("Hel"), len("lo world")]  # one insertion for the two chunks
    stream(1)
    assert "world!" in view.toPlainText()  # reading the transcript shows what is pending
    stream(1)
    conversation.apply(Tally(started=0.0, generated=5).finished("eos", "Hello world! more"))
    QApplication.processEvents()
    assert view.messages()[-1].content == "Hello world! more"
    assert view.document().toPlainText().count("Hello world! more") == 1


def test_the_chats_scroll_bar_is_a_flat_handle_without_arrow_buttons(qtbot):
    """Each streamed update repaints the chat's scroll bar (its range grows): the flat one has
    no arrow buttons, only a handle that still spans the part of the text in view."""
    view = ChatView(Conversation())
    qtbot.addWidget(view)
    view.resize(300, 200)
    view.show()
    view.conversation.add_user("line\n" * 30, GenerationSettings(), None)
    bar = view.verticalScrollBar()
    qtbot.waitUntil(lambda: bar.maximum() > 0, timeout=5000)
    option = QStyleOptionSlider()
    option.initFrom(bar)
    option.orientation = Qt.Orientation.Vertical
    option.minimum, option.maximum = bar.minimum(), bar.maximum()
    option.sliderPosition = option.sliderValue = bar.value()
    option.pageStep = bar.pageStep()
    option.subControls = QStyle.SubControl.SC_All
    style, control = bar.style(), QStyle.ComplexControl.CC_ScrollBar
    for button in (QStyle.SubControl.SC_ScrollBarAddLine, QStyle.SubControl.SC_ScrollBarSubLine):
        assert style.subControlRect(control, option, button, bar).height() == 0
    handle = style.subControlRect(control, option, QStyle.SubControl.SC_ScrollBarSlider, bar)
    shown = bar.pageStep() / (bar.maximum() - bar.minimum() + bar.pageStep())
    assert handle.height() == pytest.approx(shown * bar.height(), abs=6)


def test_streamed_text_waits_for_a_longer_frame_within_its_bounds(qtbot):
    """A window over its CPU budget draws streamed text less often, never under twice a
    second nor over 10 times."""
    conversation = Conversation()
    view = ChatView(conversation)
    qtbot.addWidget(view)
    view.set_stream_interval(10_000)
    assert view.stream_interval_ms == SLOWEST_STREAM_FRAME_MS
    view.set_stream_interval(1)
    assert view.stream_interval_ms == STREAM_FRAME_MS
    view.set_stream_interval(200)
    conversation.add_user("Hi", GenerationSettings(), None)
    conversation.start_reply(GenerationSettings(), None)
    conversation.apply(Token(0, 0, "Hel", "Hel", 0.01, 0, ()))
    shown_at = time.monotonic()
    conversation.apply(Token(1, 1, "lo", "lo", 0.01, 0, ()))
    assert "Hello" not in view.document().toPlainText()  # waits for its frame
    qtbot.waitUntil(lambda: "Hello" in view.document().toPlainText(), timeout=5000)
    assert time.monotonic() - shown_at >= 0.2 * 0.9  # its frame, not the fastest one


def test_a_batch_of_tokens_is_one_chat_update_with_the_text_of_single_deliveries(qtbot):
    """N tokens delivered together (one worker batch) draw the same text as N delivered one
    by one, in one insertion into the chat view, and the conversation keeps every token."""
    pieces = ("Hel", "lo ", "**wor", "ld**", "\n", "ok")
    tokens = [Token(i, i, text, text, 0.01, 0, ()) for i, text in enumerate(pieces)]
    end = Tally(started=0.0, generated=len(pieces)).finished("eos", "".join(pieces))
    views = []
    for batches in ([[one] for one in tokens], [tokens[:1], tokens[1:]]):
        conversation = Conversation()
        view = ChatView(conversation)
        qtbot.addWidget(view)
        conversation.add_user("Hi", GenerationSettings(), None)
        conversation.start_reply(GenerationSettings(), None)
        updates = []
        for batch in batches:
            before = view.stream_updates
            conversation.apply_many(batch)
            view.flush()  # the batch's frame, now
            updates.append(view.stream_updates - before)
        assert updates == [1] * len(batches)  # one chat update per delivery, whatever its size
        assert conversation.reply.parts == list(pieces)
        views.append(view)
    assert views[0].toPlainText() == views[1].toPlainText()
    assert views[1].reply_text() == "".join(pieces)
    for view in views:
        view.conversation.apply(end)
    assert views[0].toPlainText() == views[1].toPlainText()
    assert views[1].messages()[-1].content == "".join(pieces)


@pytest.mark.parametrize("budget", [None, 48 * 60])
def test_rows_pooled_as_they_arrive_equal_a_pooling_from_scratch(rng, budget):
    """`extend` after each row (whole blocks only), then a frame's `update`: the same cells and
    colour levels as pooling every row at once, across the buffer halving and factor changes.
    With a cell budget the rows kept shrink as keys grow (48 to 16 here), and the row factor
    follows them down."""
    rows = AttentionRows(HEADS, max_rows=48, max_cells=budget)
    pooled = pooled_rows.PooledRows()
    rows.append_block(causal(rng, 5, 5))
    pooled.update(rows, max_rows=10, max_keys=16)
    for keys in range(6, 200):
        rows.append_row(causal(rng, 1, keys)[:, 0, :])
        pooled.extend(rows)
        if keys % 7 == 0:  # a frame now and then
            cells, row_factor, key_factor = pooled.update(rows, max_rows=10, max_keys=16)
            fresh = pooled_rows.PooledRows()
            fresh._key = (*pooled._key[:4], 0)  # the same sticky row factor
            expected, *factors = fresh.update(rows, max_rows=10, max_keys=16)
            assert factors == [row_factor, key_factor]
            np.testing.assert_array_equal(cells, expected)
            np.testing.assert_array_equal(pooled.levels(), fresh.levels())
    assert rows.dropped > 0 and pooled.update(rows, 10, 16)[1] > 1  # halved and pooled rows
    limit = rows.limit(rows.keys)
    assert pooled.update(rows, 10, 16)[1] == pooled_rows.pool_factor(limit, 10)
    assert limit == (16 if budget else 48)


def test_a_new_replys_pooling_reuses_the_buffer_and_leaves_nothing_of_the_last(rng):
    """The next reply pools into the same buffer, its old cells cleared: the cells and colour
    levels equal a pooling from scratch, for a shorter reply after a longer one too."""
    pooled = pooled_rows.PooledRows()
    long_rows = AttentionRows(HEADS)
    long_rows.append_block(causal(rng, 60, 90))
    pooled.update(long_rows, max_rows=16, max_keys=32)
    buffer = pooled._data
    short = AttentionRows(HEADS)
    short.append_block(causal(rng, 9, 14))
    cells, *factors = pooled.update(short, max_rows=16, max_keys=32)
    fresh = pooled_rows.PooledRows()
    expected, *fresh_factors = fresh.update(short, max_rows=16, max_keys=32)
    assert pooled._data is buffer and factors == fresh_factors
    np.testing.assert_array_equal(cells, expected)
    np.testing.assert_array_equal(pooled.levels(), fresh.levels())
    assert not buffer[:, cells.shape[1] :].any() and not buffer[:, :, cells.shape[2] :].any()


def test_rows_arriving_between_frames_are_pooled_with_their_batch(qtbot, docked, rng, monkeypatch):
    """A frame after many tokens pools at most the last block of rows: the rest was pooled as
    each batch arrived, so no single frame takes the whole backlog at once."""
    view = docked.view
    view.docks["attention"].setFloating(True)
    view.ingest_many([prefill(rng, prompt=40)])
    qtbot.waitUntil(lambda: shown(view.attention))
    docked.tick()
    pooled_rows: list[int] = []
    padded = AttentionRows.padded

    def counted(self, first_row, keys, end_row=None, scratch=None):
        block = padded(self, first_row, keys, end_row, scratch)
        pooled_rows.append(block.shape[1])
        return block

    monkeypatch.setattr(AttentionRows, "padded", counted)
    for index in range(36):
        view.ingest_many([token(rng, index, prompt=40)])
        if index == 20:
            docked.tick()  # a frame picks the pooling factors for this size
            key = view.attention._pooled._key
            pooled_rows.clear()
    assert len(pooled_rows) >= 15  # pooled as the batches came
    pooled_rows.clear()
    docked.tick()
    assert view.attention._pooled._key == key  # same factors: the frame did not start over
    assert 0 < sum(pooled_rows) <= 2 * key[3]  # the frame: the last block or two


def test_the_context_bar_moves_without_painting_inside_the_frame(qtbot):
    """QProgressBar.setValue paints the bar at once when it moves; the KV panel's bar paints
    with the next ordinary paint instead, and shows the new value."""
    bar = QProgressBar()
    qtbot.addWidget(bar)
    bar.resize(400, 20)
    bar.show()
    qtbot.waitExposed(bar)
    paints = _Events(bar, QEvent.Type.Paint)
    bar.setRange(0, 1000)
    qtbot.waitUntil(lambda: paints.count > 0)  # the first paint
    QApplication.processEvents()
    before = paints.count
    bar.setValue(10)  # what the panel avoids: a paint inside the call
    assert paints.count > before
    before = paints.count
    set_bar(bar, 700, 1000)
    assert paints.count == before and (bar.value(), bar.maximum()) == (700, 1000)
    qtbot.waitUntil(lambda: paints.count > before)  # painted later, with the event loop
    QApplication.processEvents()
    before = paints.count
    set_bar(bar, 700, 1000)  # unchanged: nothing to paint
    QApplication.processEvents()
    assert paints.count == before


def floating_with_a_reply(qtbot, docked, rng):
    """Every panel floating and shown, a prompt and a first token drawn: the view."""
    view = docked.view
    for name in PANELS:
        view.docks[name].setFloating(True)
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    qtbot.waitUntil(lambda: all(shown(getattr(view, name)) for name in PANELS))
    frames_asked_for_are_done(qtbot, view)
    return view


def _ticked_while_stale(view: InternalsView) -> bool:
    """Tick (the timer's slot) if a panel on screen still needs a frame; whether one did (a
    panel tabbed behind another stays stale until shown: a tick does not draw it)."""
    stale = any(panel.needs_redraw() and shown(panel) for panel in view.panels)
    if stale and not view._queued:
        view._tick()
    return stale


def frames_asked_for_are_done(qtbot, view: InternalsView) -> None:
    """Docks shown ask for a frame, drawn in slices: wait until its last slice is drawn."""
    qtbot.wait(20)  # the frames the docks' showing posted have started
    qtbot.waitUntil(lambda: not view._queued, timeout=2000)


def test_a_frame_slice_is_wall_time_so_a_busy_machine_still_yields(qtbot, docked, rng):
    """A panel that waits (its CPU preempted on a loaded machine) uses no CPU time of its own:
    the frame still yields once the slice's wall time has passed."""
    view = floating_with_a_reply(qtbot, docked, rng)
    docked.tick()
    view.ingest(token(rng, 1))
    first = view.panels[0]
    redraw = first.redraw

    def preempted() -> None:
        time.sleep(2 * docks.FRAME_SLICE_S)  # wall time passes, this thread's CPU time not
        redraw()

    first.redraw = preempted
    before = dict(docked.counts)
    view._tick()
    assert sum(docked.counts[n] - before[n] for n in PANELS) <= 1  # then it yielded
    qtbot.waitUntil(lambda: all(docked.counts[n] - before[n] == 1 for n in PANELS))


def test_the_attention_overview_redraws_at_most_once_a_second_and_catches_up(
    docked, rng, monkeypatch
):
    clock = {"now": 100.0}
    monkeypatch.setattr(redraw.time, "monotonic", lambda: clock["now"])  # the throttle's clock
    view, panel = docked.view, docked.view.attention
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    docked.tick()
    stats = view.state.head_stats[1]
    np.testing.assert_allclose(panel.overview_image.image[1], stats.mean("max"), rtol=1e-5)
    drawn = panel.overview_image.image.copy()
    for index in range(1, 4):  # three tokens within the same second: the mosaic follows each
        clock["now"] += 0.1
        view.ingest(token(rng, index))
        assert docked.tick()["attention"] == 1
        assert panel._pooled._rows == view.state.attention[panel.selected_layer].rows
        np.testing.assert_array_equal(panel.overview_image.image, drawn)  # the means wait
    assert docked.tick()["attention"] == 0  # nothing new, and the overview is not due yet
    clock["now"] += 1.0  # the stream stopped: the overview still shows the latest means
    assert docked.tick()["attention"] == 1
    np.testing.assert_allclose(panel.overview_image.image[1], stats.mean("max"), rtol=1e-5)
    assert docked.tick()["attention"] == 0
    panel.measure_choice.setCurrentIndex(1)  # a new measure: at once
    assert docked.tick()["attention"] == 1
    np.testing.assert_allclose(panel.overview_image.image[1], stats.mean("entropy"), rtol=1e-5)


def test_a_prompts_statistics_are_summed_between_frames_and_the_overview_waits_for_them(
    docked, monkeypatch
):
    rng = np.random.default_rng(4)
    monkeypatch.setattr(docks, "SETTLE_SLICE_S", -1.0)  # one chunk per batch and per tick
    view, panel = docked.view, docked.view.attention
    first = prefill(rng, prompt=60)  # two chunks of rows for each of two watched layers
    view.ingest_many([first, token(rng, 0, prompt=60)])
    assert view.state.stats_pending  # the batch summed one chunk, not the whole prompt
    docked.tick()
    assert panel.slots and panel.overview_image.image is None  # the mosaic drew at once
    ticks = 0
    while view.state.stats_pending:  # each tick of the timer sums one more
        view._tick()
        ticks += 1
    assert ticks == 3
    docked.tick()
    stats = view.state.head_stats[1]
    assert stats.rows == 60
    np.testing.assert_allclose(panel.overview_image.image[1], stats.mean("max"), rtol=1e-5)


def test_an_attention_panel_behind_another_does_not_pool_arriving_rows(qtbot, docked):
    rng = np.random.default_rng(6)
    view, panel = docked.view, docked.view.attention
    view.ingest_many([prefill(rng), token(rng, 0)])
    docked.tick()
    assert panel._pooled._rows > 0 and shown(panel)
    view.docks["next_token"].raise_()  # the attention panel is now tabbed behind it
    qtbot.waitUntil(lambda: not shown(panel))
    qtbot.wait(50)  # the raise's own redraw has run
    drawn, pooled = docked.counts["attention"], panel._pooled._rows
    for index in range(1, 40):  # enough new rows to fill whole pooled blocks
        view.ingest_many([token(rng, index)])
    assert panel._pooled._rows == pooled  # no pooling for a panel no one sees
    view.docks["attention"].raise_()
    qtbot.waitUntil(lambda: docked.counts["attention"] == drawn + 1)  # at once when raised
    assert panel._pooled._rows == view.state.attention[panel.selected_layer].rows


def test_frames_counts_the_timer_ticks_that_redrew_a_panel(qtbot, docked, rng, monkeypatch):
    """What bench --window reports as the panels' frame rate: a tick that redraws panels is
    one frame however many it drew, even when it yields between them; a tick with nothing
    new is none."""
    view = docked.view
    monkeypatch.setattr(docks, "FRAME_SLICE_S", 0.0)  # yield after every panel
    # only the ticks' frames: a dock that shows late (a loaded machine) starts one of its own
    monkeypatch.setattr(view, "_frame_for_shown_dock", lambda: None)
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    before = view.frames
    view._tick()
    qtbot.waitUntil(lambda: not view._queued, timeout=2000)  # the rest of the frame
    assert view.frames == before + 1 and sum(docked.counts.values()) >= 2
    while any(panel.needs_redraw() and docks.shown(panel) for panel in view.panels):
        view._tick()  # what a prompt leaves for later frames (its statistics, the overview)
        qtbot.waitUntil(lambda: not view._queued, timeout=2000)
    frames = view.frames
    view._tick()
    assert view.frames == frames  # nothing changed: no frame
    view.ingest(token(rng, 1))
    view._tick()
    qtbot.waitUntil(lambda: not view._queued, timeout=2000)
    assert view.frames == frames + 1


def test_timers_run_between_the_slices_of_a_frame(qtbot, docked, rng, monkeypatch):
    """A frame's next slice waits for the event loop's timers (input, the heartbeat of
    bench --window): queued as a posted event, the slices and the repaints they queued ran
    back to back."""
    view = floating_with_a_reply(qtbot, docked, rng)
    # the redraws the docks' showing asked for, done; the fixture stopped the timer, so tick as
    # it would: the attention overview, throttled, falls due a while after a slow frame
    qtbot.waitUntil(lambda: not _ticked_while_stale(view), timeout=5000)
    qtbot.wait(100)
    view.ingest(token(rng, 1))  # every panel stale again
    monkeypatch.setattr(docks, "FRAME_SLICE_S", 0.0)  # yield after every panel
    order: list[str] = []
    for name in PANELS:
        panel = getattr(view, name)
        redraw = panel.redraw

        def logged(redraw=redraw, name=name) -> None:
            order.append(name)
            redraw()

        panel.redraw = logged
    beat = QTimer()
    beat.setTimerType(Qt.TimerType.PreciseTimer)
    beat.setInterval(1)
    beat.timeout.connect(lambda: order.append("beat"))
    view._tick()  # the first slice, now
    beat.start()
    qtbot.waitUntil(lambda: not view._queued, timeout=3000)
    beat.stop()
    drawn = [i for i, item in enumerate(order) if item != "beat"]
    assert len(drawn) == len(PANELS)
    between = order[drawn[0] : drawn[-1]]
    assert between.count("beat") >= len(PANELS) - 1  # a timer ran before every later slice


def test_a_tick_right_after_a_delivery_draws_at_the_event_loops_next_turn(
    qtbot, docked, rng, monkeypatch
):
    """The timer's tick that falls due as other heavy work ends (a delivery of events, which
    shares the view's turns: app.window.assembly) gives way: it draws nothing in that turn,
    and the frame follows at a later one."""
    view = docked.view
    # only the tick's frame: a dock that shows late (a loaded machine) starts one of its own
    monkeypatch.setattr(view, "_frame_for_shown_dock", lambda: None)
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    before, redraws = view.frames, sum(docked.counts.values())
    with view.turns.piece():  # a delivery long enough to count
        time.sleep(2 * turns.LIGHT_S)
    view._on_timer()
    if view.turns.just_worked():  # (a very slow machine may have let a turn pass)
        assert view.frames == before and sum(docked.counts.values()) == redraws
    qtbot.waitUntil(lambda: view.frames > before, timeout=5000)
    assert sum(docked.counts.values()) > redraws


def test_the_mosaic_paints_once_a_frame_as_its_extent_grows(qtbot, docked, rng):
    """A new row moves the mosaic's view: each frame is one paint of the mosaic (as a
    pyqtgraph view, a moved range queued a second paint after the first)."""
    view = floating_with_a_reply(qtbot, docked, rng)
    panel = view.attention
    paints = _Events(panel.mosaic, QEvent.Type.Paint)
    for index in range(1, 6):
        view.ingest(token(rng, index))
        extent = panel.mosaic.view_rect
        before = paints.count
        panel.redraw()
        assert panel.mosaic.view_rect != extent  # a row and a key more: the view moved
        qtbot.waitUntil(lambda before=before: paints.count > before)
        qtbot.wait(30)  # anything the paint queued behind it
        assert paints.count == before + 1


def test_token_axes_take_room_only_while_a_lone_head_shows_its_tokens(qtbot, docked, rng):
    """The token axes show only for a lone head with room for its tokens; hidden, the tiles
    have the whole mosaic, shown they sit right of and under the axes' text."""
    view = floating_with_a_reply(qtbot, docked, rng)
    panel, mosaic = view.attention, view.attention.mosaic
    docked.tick()
    assert panel.slots == tuple(range(HEADS))
    assert not panel.key_axis.shown and not panel.query_axis.shown
    assert mosaic.plot_rect() == QRectF(mosaic.rect())
    panel.show_head(1)
    docked.tick()
    assert panel.key_axis.shown and panel.query_axis.shown
    area = mosaic.plot_rect()
    assert area.left() > 0 and area.top() > 0
    tile = mosaic.map_from_view(QPointF(0, 0))
    assert tile.x() >= area.left() and tile.y() >= area.top()
    assert mosaic.axis_rect(panel.query_axis).right() == area.left()
    assert mosaic.axis_rect(panel.key_axis).bottom() == area.top()
    larger = mosaic.font()
    larger.setPointSizeF(larger.pointSizeF() * 2)
    mosaic.setFont(larger)  # labels in a larger font take more room
    assert mosaic.plot_rect().left() > area.left() and mosaic.plot_rect().top() > area.top()
    panel.show_head(None)
    docked.tick()
    assert not panel.key_axis.shown and mosaic.plot_rect() == QRectF(mosaic.rect())


def test_head_labels_stay_at_screen_size_on_their_tiles(qtbot, docked, rng):
    view = floating_with_a_reply(qtbot, docked, rng)
    panel, mosaic = view.attention, view.attention.mosaic
    docked.tick()
    assert [text for text, _corner in mosaic.labels] == [f"head {h}" for h in range(HEADS)]
    height = QFontMetricsF(mosaic.font()).height()
    for slot, (text, corner) in enumerate(mosaic.labels):
        y, x = panel.layout.origin(slot)
        key_size, row_size = panel._pixel
        width = panel.layout.tile_shape[1]
        assert (corner.x(), corner.y()) == ((x + width) * key_size, y * row_size)
        # drawn at the font's size, anchored at the tile's top-right corner on screen
        box = mosaic.label_rect(text, mosaic.map_from_view(corner))
        assert box.height() == pytest.approx(height + 4)
        assert box.topRight() == mosaic.map_from_view(corner)
    # and painted there: its white text on the tile
    image = mosaic.grab().toImage()
    text, corner = mosaic.labels[0]
    box = mosaic.label_rect(text, mosaic.map_from_view(corner)).toRect()
    lightness = [
        image.pixelColor(x, y).lightness()
        for x in range(box.left(), box.right())
        for y in range(box.top(), box.bottom())
    ]
    assert max(lightness) > 200


def test_docks_shown_again_draw_in_the_timers_slices(qtbot, docked, rng, monkeypatch):
    """Showing docks draws their latest data at once, a panel a slice, never one unsliced
    redraw of every panel."""
    view = docked.view
    view.ingest(prefill(rng))
    view.ingest(token(rng, 0))
    for name in PANELS:
        view.docks[name].close()
    QApplication.processEvents()
    view.ingest(token(rng, 1))

    def unsliced(force: bool = False) -> None:
        raise AssertionError("an unsliced redraw of every panel")

    monkeypatch.setattr(view, "redraw", unsliced)
    before = dict(docked.counts)
    for name in PANELS:
        view.docks[name].setFloating(True)
        view.docks[name].show()
    qtbot.waitUntil(lambda: all(docked.counts[n] > before[n] for n in PANELS), timeout=3000)
    assert not view.timer.isActive()  # the timer took no part: the showing asked for it


def test_the_roofline_chart_stamps_its_points_over_a_kept_frame(qtbot):
    """A new decode cloud repaints the points over the kept axes and roof; a new range or a
    new roof draws those again. Each point's symbol is where its numbers put it on the log
    axes, points a log axis cannot place are kept but not drawn, and hovering one names it."""
    from PySide6.QtGui import QColor, QPen

    from ui.panels.roofline_chart import RooflineChart

    chart = RooflineChart("Roofline", "FLOP per byte", "FLOP/s")
    qtbot.addWidget(chart)
    roof = chart.add_line("memory roof", QPen(QColor(251, 188, 5), 2))
    cloud = chart.add_points("decode step", "o", 5, (52, 168, 83))
    prefill = chart.add_points("prefill", "d", 13, (66, 133, 244), outlined=True)
    chart.set_decades((-1, 3), (8, 12))
    roof.setData([0.1, 10.0], [2e9, 2e11])
    chart.resize(500, 360)
    chart.show()
    qtbot.waitExposed(chart)
    chart.grab()
    drawn = chart.frames_drawn
    for count in range(1, 6):
        x = np.linspace(1.0, 5.0, count * 10)
        cloud.set_points(x, x * 1e9)
        chart.grab()
    assert chart.frames_drawn == drawn  # only the points changed
    np.testing.assert_array_equal(cloud.xData, x)  # data units, as given
    np.testing.assert_allclose(cloud.getData()[1], np.log10(x * 1e9))  # drawn at their logs
    chart.set_decades((-1, 3), (8, 13))
    chart.grab()
    assert chart.frames_drawn == drawn + 1  # new decades
    roof.setData([0.1, 10.0], [3e9, 3e11])
    chart.grab()
    assert chart.frames_drawn == drawn + 2  # a new roof
    prefill.set_points([60.0], [9e9])
    image = chart.grab().toImage()
    centre = chart.point_at(60.0, 9e9).toPoint()
    colour = image.pixelColor(centre)
    assert (colour.red(), colour.green(), colour.blue()) == (66, 133, 244)
    assert image.pixelColor(chart.point_at(60.0, 9e10).toPoint()) != colour  # a decade above
    assert chart.describe_at(chart.point_at(60.0, 9e9)) == "prefill: 60 FLOP/byte, 9 GFLOP/s"
    assert chart.describe_at(chart.point_at(60.0, 9e10)) == ""
    cloud.set_points(np.array([0.0, 2.0]), np.array([1.0, 5.0]))  # no place on a log axis
    assert len(cloud.getData()[0]) == 1 and len(cloud.xData) == 2


def test_a_line_chart_draws_its_axes_again_only_when_they_change(qtbot):
    """Points added within the ranges repaint the curves over the axes, title and legend
    kept as pixels; a new range or legend draws those again."""
    from ui.panels.line_chart import LineChart, Series

    chart = LineChart("Decode step latency", "generated token", "latency", ((1e-3, "ms"),))
    qtbot.addWidget(chart)
    curve = chart.add_series(Series((52, 168, 83), name="this reply"))
    chart.set_range(100, 0.05)
    chart.resize(400, 200)
    chart.show()
    qtbot.waitExposed(chart)
    chart.grab()
    drawn = chart.frames_drawn
    for count in range(2, 40):
        curve.setData(np.arange(count), np.full(count, 0.03))
        chart.grab()
    assert chart.frames_drawn == drawn  # only the curve changed
    chart.set_range(200, 0.05)
    chart.grab()
    assert chart.frames_drawn == drawn + 1  # new ticks
    curve.name = "with KV cache"
    chart.grab()
    assert chart.frames_drawn == drawn + 2  # a new legend
    # The curve is drawn over the kept pixels: its line is where its points are.
    image = chart.grab().toImage()
    point = chart.point_at(20, 0.03).toPoint()
    assert image.pixelColor(point).green() > 100


def test_a_selection_draws_at_once_whatever_the_frame_rate(qtbot, docked, rng):
    """A click that selects a step is drawn at the event loop's next turn, not at the next
    tick of the governed timer (stopped here: 250-500 ms away while a reply streams or just
    after); so is the rows' arrival it asked for. Only the panels on screen draw."""
    view = docked.view
    view.ingest(prefill(rng))
    for index in range(4):
        view.ingest(token(rng, index))
    docked.tick()
    assert not any(panel.needs_redraw() for panel in view.panels if shown(panel))
    before = dict(docked.counts)
    view.state.select(view.state.prompt_tokens + 2)  # what a click on the third token does
    qtbot.waitUntil(lambda: docked.counts["attention"] > before["attention"], timeout=5000)
    qtbot.waitUntil(lambda: not view.frame_in_progress)
    assert not any(panel.needs_redraw() for panel in view.panels if shown(panel))
    assert docked.counts["kv_cache"] == before["kv_cache"]  # tabbed behind: it waits


def test_a_replys_end_draws_at_once_whatever_the_frame_rate(qtbot, docked, rng):
    """The panels' final numbers show as the reply ends (when the chat says it is done), not
    at the governed timer's next tick (stopped here)."""
    from tests.ui.test_panels import finished

    view = docked.view
    view.ingest(prefill(rng))
    tokens = [token(rng, index) for index in range(4)]
    for event in tokens:
        view.ingest(event)
    docked.tick()
    before = docked.counts["timing"]
    view.ingest(finished(tokens))
    qtbot.waitUntil(lambda: docked.counts["timing"] > before, timeout=5000)
    qtbot.waitUntil(lambda: not view.frame_in_progress)
    assert not view.timing.needs_redraw()
