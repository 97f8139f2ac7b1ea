"""The internals docks and the one timer that redraws them."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import psutil
from PySide6.QtCore import QObject, Qt, QTimer, Signal
from PySide6.QtGui import QRegion
from PySide6.QtWidgets import QDockWidget, QMainWindow, QWidget

from engine.events import Event, ModelInfo
from ui.panels.attention import AttentionPanel
from ui.panels.kv_cache import KvCachePanel
from ui.panels.layers import LayersPanel
from ui.panels.next_token import NextTokenPanel
from ui.panels.placement import PlacementPanel
from ui.panels.roofline import RooflinePanel
from ui.panels.state import ATTENTION_CELLS, InternalsState
from ui.panels.timing import TimingPanel
from ui.panels.tokens import TokensPanel
from ui.turns import GIVE_WAY_MS, Turns


def window_cpu_share(cores: int | None) -> float:
    """The window's CPU budget (see below) on a machine of `cores` physical cores. On one or
    two, the engine decodes on every core (app.server.engine_server.Threads): each hundredth
    of a core the window takes there costs decoding about 1% of its speed, so the window keeps
    to 0.04 of a core. On more, the engine leaves the window a core of its own, and frames
    take nothing from it."""
    return 0.04 if (cores or 1) <= 2 else 0.12


FRAME_MS = 33  # about 30 redraws a second at most
# What the panels on screen want of the rows: (layers, seconds between frames, mosaic grid).
RowsWanted = tuple[tuple[int, ...], float, tuple[int, int] | None]
# The window must not slow the model it shows. When the window's process as a whole (the GUI
# thread's panels, chat and event delivery, and the thread that receives the engine's events)
# uses more than WINDOW_CPU_SHARE of a core while panels redraw, they redraw less often, down
# to SLOWEST_FRAME_MS between frames; when it is well under, they speed up again. The whole
# process, not the GUI thread alone: on two cores every slice of it, in any thread, holds one
# of the engine's two threads up (the engine decodes slower in proportion to the share of a
# core the window takes, whichever thread takes it).
# The rate found is kept for the next reply: a second with nothing to draw (the wait for a
# prefill) says nothing about what frames cost, and starting each reply at 30 Hz again spent
# its first seconds far over budget.
# 2 frames a second: slower would no longer read as live. With all five panels floating on
# a busy 2-core machine a frame is costly, and at 4 frames a second (the floor before) the
# panels alone took more than the whole budget.
SLOWEST_FRAME_MS = 500
WINDOW_CPU_SHARE = window_cpu_share(psutil.cpu_count(logical=False))
GOVERN_WINDOW_S = 1.0  # how long a CPU share is measured over before the rate changes
# The rate the first reply starts at, before any has been found: 4 frames a second. Started at
# 30, a first reply spent its first second at half a core drawing while the governor measured;
# at 10, with five floating panels on 2 cores, still well over budget. A machine with room to
# spare reaches 30 a second within three governor windows (the interval halves each time).
FIRST_BUSY_FRAME_MS = 250
# A frame draws panels one after another until this much time has passed, then lets the
# event loop run (paint, input) before the next ones: no frame holds the loop for all five.
# Wall time, not the thread's CPU time: on a busy machine a slice counted in CPU time held the
# loop for several times as long. In practice one panel a slice: a panel's repaint runs in the
# loop's next pass, with the next panel's redraw, and longer slices made long passes.
FRAME_SLICE_S = 0.002
# The timer sleeps once no panel on screen has anything left to draw and none has drawn for
# this long (longer than the panels' throttled summaries wait: TIMELINE_INTERVAL_S and the
# like, 1 s); data for a panel on screen, a dock shown or a panel's own choice wakes it. Each
# tick wakes the GUI thread (a little CPU) whether or not it draws: 30 a second while
# idle, waiting for a prefill or with every dock closed.
SLEEP_AFTER_S = 1.5
# Statistics a long block of attention rows left to sum (a prompt's) are summed for about this
# long after each delivered batch and each tick, a piece at a time (InternalsState.settle).
SETTLE_SLICE_S = 0.004

# (objectName for QMainWindow.saveState, title, attribute holding the panel)
DOCKS = (
    ("internals_timing", "Timing", "timing"),
    ("internals_kv_cache", "KV cache", "kv_cache"),
    ("internals_attention", "Attention", "attention"),
    ("internals_next_token", "Next token", "next_token"),
    ("internals_roofline", "Roofline", "roofline"),
    ("internals_tokens", "Tokens", "tokens"),
    ("internals_placement", "Placement", "placement"),
    ("internals_layers", "Layers", "layers"),
)


class Panel(Protocol):
    unfinished: bool  # the last redraw left work for the frame's next slice

    def needs_redraw(self) -> bool: ...

    def redraw(self) -> None: ...

    def isVisible(self) -> bool: ...

    def visibleRegion(self) -> QRegion: ...

    def window(self) -> QWidget: ...


class InternalsView(QObject):
    """Owns the state, the panels, their docks and the redraw timer.

    Feed it from the GUI thread: `set_model` on load, `ingest` for every engine event.
    Ingesting never draws; the timer redraws each visible panel whose data changed, about 30
    times a second, less often while the window's process is busier than WINDOW_CPU_SHARE of a core.
    The timer sleeps while no panel on screen has anything to draw (see SLEEP_AFTER_S); it
    only ever sleeps while running, so a timer stopped by its owner (a test driving frames by
    hand) stays stopped.
    """

    # The user picked a layer that is not watched: capture these layers from the next reply on.
    watched_layers_requested = Signal(tuple)
    # The interval between frames while panels redraw changed (ms): events need not arrive
    # more often than that (app.window.assembly has the worker deliver them at that pace).
    frame_interval_changed = Signal(int)
    # The layers whose attention rows a panel on screen draws (() : none), the seconds
    # between its frames (the engine sends the latest rows no more often) and the cells its
    # mosaic has room for, (rows, keys) or None (a prompt crosses pooled near them): the
    # arguments of EngineClient.watch.
    rows_wanted = Signal(tuple, float, object)

    def __init__(
        self,
        parent: QObject | None = None,
        max_attention_rows: int = 256,
        max_attention_cells: int | None = ATTENTION_CELLS,
    ) -> None:
        super().__init__(parent)
        self.state = InternalsState(max_attention_rows, max_attention_cells)
        self.timing = TimingPanel(self.state)
        self.kv_cache = KvCachePanel(self.state)
        self.attention = AttentionPanel(self.state)
        self.next_token = NextTokenPanel(self.state)
        self.roofline = RooflinePanel(self.state)
        self.tokens = TokensPanel(self.state)
        self.placement = PlacementPanel(self.state)
        self.layers = LayersPanel(self.state)
        self.attention.watched_layers_requested.connect(self.watched_layers_requested)
        self.attention.shown_layer_changed.connect(self._update_rows_wanted)
        self.attention.grid_changed.connect(self._update_rows_wanted)
        self.docks: dict[str, QDockWidget] = {}
        for name, title, attribute in DOCKS:
            dock = QDockWidget(title)
            dock.setObjectName(name)
            dock.setWidget(getattr(self, attribute))
            # Shown again (un-tabbed, restored, reopened): draw the latest data at once rather
            # than show the frame it had when it was hidden until the next tick.
            dock.visibilityChanged.connect(self._on_dock_visibility)
            self.docks[attribute] = dock
        # Shared with the events' delivery (assembly): a frame and a delivery that fall due
        # together take turns of the event loop of their own (ui.turns)
        self.turns = Turns()
        self.timer = QTimer(self)
        self.timer.setInterval(FRAME_MS)
        self.timer.timeout.connect(self._on_timer)
        self._given_way = QTimer(self)  # a tick that gave way to a delivery, a turn later
        self._given_way.setSingleShot(True)
        self._given_way.setInterval(GIVE_WAY_MS)
        self._given_way.timeout.connect(self._on_timer)
        self._window = (time.perf_counter(), time.process_time())
        self._drawn_in_window = 0  # panel redraws since the window began
        self.busy_interval = FIRST_BUSY_FRAME_MS  # the interval found while panels redraw
        self._queued: list[Panel] = []  # this frame's panels still to draw
        # The rest of a frame, once the event loop has had its turn. A timer object, not
        # QTimer.singleShot(0, ...): that posts an event, and posted events (the next slice, the
        # repaints the last one queued, pyqtgraph's scene updates) ran back to back, timers
        # and input waiting, for a long while at a reply's first frame.
        self._next_slice = QTimer(self)
        self._next_slice.setSingleShot(True)
        self._next_slice.setInterval(1)  # 0 sometimes kept other timers out between slices
        self._next_slice.timeout.connect(self._on_next_slice)
        self.frames = 0  # timer ticks that redrew at least one panel (a benchmark reads it)
        self._frame_counted = False
        self._frames_at_window = 0
        self._batches_in_window = 0  # batches of events ingested since the window began
        self.asleep = False  # the timer was stopped because nothing on screen needed it
        self._active_at = time.monotonic()  # last redraw or wake-up: sleep comes after it
        self.sleeps = 0  # times the timer went to sleep (tests read it)
        self.state.panel_changed = self._on_panel_changed
        # A panel's own change (a selection, a choice on a panel, the rows or lens a selection
        # asked for, a teacher's step) draws at once rather than at the next tick, which while
        # a reply streams or just after is 250-500 ms away
        self._soon = QTimer(self)
        self._soon.setSingleShot(True)
        self._soon.setInterval(1)
        self._soon.timeout.connect(self._start_frame)
        self._rows_wanted: RowsWanted | None = None
        self.frame_interval_changed.connect(self._update_rows_wanted)
        self.timer.start()

    @property
    def panels(self) -> tuple[Panel, ...]:
        return (
            self.timing,
            self.kv_cache,
            self.attention,
            self.next_token,
            self.roofline,
            self.tokens,
            self.placement,
            self.layers,
        )

    # -- feeding ---------------------------------------------------------------------------

    def set_model(self, info: ModelInfo) -> None:
        self.state.set_model(info)
        self.wake()

    def ingest(self, event: Event) -> None:
        self.state.ingest(event)
        self._wake_for_data()

    def ingest_many(self, events: Iterable[Event]) -> None:
        """A batch of events in order (e.g. MainWindow.events_received)."""
        self.state.ingest_many(events)
        if not self._batches_in_window:  # events again: the idle time before (a prefill's wait)
            self._restart_window()  # says nothing of what streaming frames cost
        self._batches_in_window += 1
        if shown(self.attention):  # tabbed behind, closed or minimised: it pools when shown
            self.attention.prepare()
        self.state.settle(self._settle_deadline())
        self._wake_for_data()
        if self.state.explaining and not self._queued:
            self._start_frame()  # a step a teacher waits for: drawn now, not at the next tick

    def set_next_reply_label(self, label: str) -> None:
        """Legend label of the coming reply's step-latency curve; see timing.cache_label."""
        self.state.set_next_reply_label(label)

    def set_explaining(self, on: bool) -> None:
        """A teacher steps through replies (paused, Next token, Play slowly): each panel says
        what the selected step did, and every delivered step is drawn at once. Events come at
        the fastest pace while stepping, so a Next token shows within a frame or two."""
        self.state.set_explaining(on)
        self.frame_interval_changed.emit(FRAME_MS if on else self.busy_interval)
        self.wake()

    def set_watched_layers(self, layers: Sequence[int]) -> None:
        self.state.set_watched_layers(layers)
        self._update_rows_wanted()
        self.wake()

    def _update_rows_wanted(self) -> None:
        """Say which rows the panels on screen draw, and how often, when that changed: the
        layer the attention mosaic shows, where it is watched (the others' rows, and their
        prompt matrices, cross when the panel switches to one)."""
        layer = self.attention.shown_layer
        layers: tuple[int, ...] = ()
        if layer is not None and layer in self.state.watched_layers and shown(self.attention):
            layers = (layer,)
        interval = FRAME_MS if self.state.explaining else self.busy_interval
        wanted = (layers, interval / 1000, self.attention.grid if layers else None)
        if wanted != self._rows_wanted:
            self._rows_wanted = wanted
            self.rows_wanted.emit(*wanted)

    @property
    def rows_wanted_now(self) -> RowsWanted:
        """What `rows_wanted` said last (or would say now, before it said anything)."""
        if self._rows_wanted is None:
            self._update_rows_wanted()
        assert self._rows_wanted is not None  # set by _update_rows_wanted
        return self._rows_wanted

    def compare_with_previous(self, enabled: bool) -> None:
        self.timing.compare_with_previous(enabled)

    def clear(self) -> None:
        """A new chat: forget every reply, keep the model and the watched layers."""
        self.state.clear()
        self.wake()

    # -- sleeping --------------------------------------------------------------------------

    def wake(self) -> None:
        """Start the timer again if it sleeps (new data, a dock shown, a panel's choice)."""
        self._active_at = time.monotonic()
        if self.asleep:
            self.asleep = False
            self._restart_window()
            self.timer.start()

    def _restart_window(self) -> None:
        """A fresh window for the governor's CPU share (see _govern)."""
        self._window = (time.perf_counter(), time.process_time())
        self._drawn_in_window = 0
        self._frames_at_window = self.frames

    def _on_panel_changed(self) -> None:
        self.wake()
        self._soon.start()

    def _wake_for_data(self) -> None:
        # A panel off screen draws when it is shown (its dock's visibilityChanged wakes us).
        if self.asleep and any(shown(panel) for panel in self.panels):
            self.wake()

    def _sleep_if_idle(self) -> None:
        """Stop the timer when nothing on screen is left to draw (only a running timer)."""
        if self._queued or not self.timer.isActive() or self.state.stats_pending:
            return
        if time.monotonic() - self._active_at < SLEEP_AFTER_S:
            return
        if any(panel.needs_redraw() and shown(panel) for panel in self.panels):
            return
        self.timer.stop()
        self.asleep = True
        self.sleeps += 1

    # -- drawing ---------------------------------------------------------------------------

    def _on_timer(self) -> None:
        """The timer's tick, at the event loop's next turn if a delivery just ended."""
        self.turns.take(self._tick, self._given_way.start)

    def _on_next_slice(self) -> None:
        self.turns.take(self._draw_queued, self._next_slice.start)

    def _tick(self) -> None:
        self._govern()
        if self.state.stats_pending:
            self.state.settle(self._settle_deadline())
        self._start_frame()
        self._sleep_if_idle()

    @property
    def frame_in_progress(self) -> bool:
        """Whether a frame's panels are still being drawn, a slice at a time."""
        return bool(self._queued)

    def _settle_deadline(self) -> float | None:
        """How long the prompt's statistics are summed now: a slice at full speed, all of them
        while a teacher steps (the next step then shows every panel at once, its overview too,
        rather than a slice a tick later)."""
        return None if self.state.explaining else time.perf_counter() + SETTLE_SLICE_S

    def _start_frame(self) -> None:
        if not self._queued:  # else the last frame is still being drawn
            self._queued = list(self.panels)
            self._frame_counted = False
            self._draw_queued()

    def _frame_for_shown_dock(self) -> None:
        """A dock was shown: a frame now, or, with one under way, every panel it has passed
        (one skipped while its dock was still hidden) joins it."""
        if self._queued:
            self._queued += [panel for panel in self.panels if panel not in self._queued]
        else:
            self._start_frame()

    def _draw_queued(self) -> None:
        """Draw this frame's panels that are stale and on screen, a slice at a time."""
        started = time.perf_counter()
        while self._queued:
            panel = self._queued.pop(0)
            if panel.needs_redraw() and shown(panel):
                panel.redraw()
                self._drawn(1)
                if panel.unfinished:
                    self._queued.append(panel)
                if not self._frame_counted:
                    self.frames += 1
                    self._frame_counted = True
                if self._queued and time.perf_counter() - started > FRAME_SLICE_S:
                    self._next_slice.start()
                    return

    def _govern(self) -> None:
        """Every GOVERN_WINDOW_S, set the frame interval from the window process's CPU share.

        Only a window in which panels redrew moves `busy_interval`, and only one in which
        events arrived and at least half the frames its interval allows were drawn may make
        it shorter: a few redraws between replies (a new chat clearing the panels) on an
        idle thread say nothing about what streaming frames cost, and sped the next reply's
        first second up to 30 Hz. A
        window without any redraw (idle, or waiting for a prefill) returns the timer to
        FRAME_MS, so a click on a panel shows at once; the first redraw after it goes back to
        `busy_interval`.
        """
        started, cpu = self._window
        now, cpu_now = time.perf_counter(), time.process_time()
        if now - started < GOVERN_WINDOW_S:
            return
        drawn, self._drawn_in_window = self._drawn_in_window, 0
        frames, self._frames_at_window = self.frames - self._frames_at_window, self.frames
        streamed, self._batches_in_window = self._batches_in_window > 0, 0
        self._window = (now, cpu_now)
        if drawn:
            share = (cpu_now - cpu) / (now - started)
            allowed = (now - started) * 1000 / self.busy_interval
            if share > WINDOW_CPU_SHARE or (streamed and frames >= allowed / 2):
                interval = frame_interval(self.busy_interval, share)
                if interval != self.busy_interval:
                    self.busy_interval = interval
                    self.frame_interval_changed.emit(interval)
        self._set_interval(self.busy_interval if drawn else FRAME_MS)

    def _drawn(self, panels: int) -> None:
        if not self._drawn_in_window:  # the first redraw after an idle window
            self._set_interval(self.busy_interval)
        self._drawn_in_window += panels
        self._active_at = time.monotonic()

    def _set_interval(self, interval: int) -> None:
        if interval != self.timer.interval():
            self.timer.setInterval(interval)

    def _on_dock_visibility(self, visible: bool) -> None:
        # After the change: a dock's visibility is what `shown` reads.
        QTimer.singleShot(0, self, self._update_rows_wanted)
        # A frame in slices, as the timer's: several docks shown at once (a restored window,
        # floated docks) each asked for an unsliced redraw of every panel.
        if visible:
            self.wake()
            QTimer.singleShot(0, self, self._frame_for_shown_dock)

    def redraw(self, force: bool = False) -> None:
        """The timer's slot: redraw the visible panels whose data changed (all with force)."""
        if force:
            self.state.settle()
        for panel in self.panels:
            if panel.needs_redraw() and (force or shown(panel)):
                panel.redraw()
                while panel.unfinished:  # all of it now, not a slice at a time
                    panel.redraw()
                self._drawn(1)


def frame_interval(interval_ms: int, cpu_share: float) -> int:
    """The next frame interval, given the window process's CPU share over the last window.

    Over WINDOW_CPU_SHARE: longer in proportion to the overshoot, at least 1.5x (at most
    SLOWEST_FRAME_MS), so a thread three times over budget backs off in one window rather than
    spending seconds at rates it cannot afford. Under half of it: 2x shorter (at least
    FRAME_MS). In between: unchanged, so the rate settles instead of oscillating.
    """
    if cpu_share > WINDOW_CPU_SHARE:
        factor = max(cpu_share / WINDOW_CPU_SHARE, 1.5)
        return min(math.ceil(interval_ms * factor), SLOWEST_FRAME_MS)
    if cpu_share < WINDOW_CPU_SHARE / 2:
        return max(math.floor(interval_ms / 2), FRAME_MS)
    return interval_ms


def on_screen(panel: Panel) -> bool:
    """Whether the panel is visible and not covered by a tab; in a minimised window too. (The
    timer may sleep while every panel is minimised: a restored window's docks report their
    visibility, which wakes it.)"""
    return panel.isVisible() and not panel.visibleRegion().isEmpty()


def shown(panel: Panel) -> bool:
    """Whether any of the panel is on screen now.

    A dock tabbed behind another still reports isVisible(): its visible region is empty. A
    minimised window keeps both, so every window up the parent chain is asked too (a floating
    dock is a window of its own whose parent is the main window).
    """
    if not on_screen(panel):
        return False
    widget: QWidget | None = panel.window()
    while widget is not None:
        if widget.isMinimized():
            return False
        parent = widget.parentWidget()
        widget = parent.window() if parent is not None else None
    return True


def build_docks(
    window: QMainWindow,
    area: Qt.DockWidgetArea = Qt.DockWidgetArea.RightDockWidgetArea,
) -> InternalsView:
    """Add the docks to `window` in two tab groups: timing + KV cache + roofline + placement,
    attention + next token + tokens + layers.

    Call it before `window.restoreState(...)` so the saved layout finds the docks by name.
    """
    view = InternalsView(window)
    docks = view.docks
    for dock in docks.values():
        window.addDockWidget(area, dock)
    window.tabifyDockWidget(docks["timing"], docks["kv_cache"])
    window.tabifyDockWidget(docks["kv_cache"], docks["roofline"])
    window.tabifyDockWidget(docks["roofline"], docks["placement"])
    window.tabifyDockWidget(docks["attention"], docks["next_token"])
    window.tabifyDockWidget(docks["next_token"], docks["tokens"])
    window.tabifyDockWidget(docks["tokens"], docks["layers"])
    docks["timing"].raise_()
    docks["attention"].raise_()
    return view
