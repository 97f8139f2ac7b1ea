"""Hands the engine's events to the GUI thread in time-sliced batches.

Events are not sent as one queued signal per token: at hundreds of tokens per second that floods
the GUI event loop. The thread that receives them from the engine appends them to a locked
buffer instead (`push`), and a GUI-thread QTimer drains it 2 to 30 times a second, handing
batches to `deliver`. A job's end is marked with the number of events pushed by then (`end_at`),
and `reached(job)` is called once that many were delivered: listeners see a reply's Finished
before they hear that its job ended.

The GUI must stay responsive however fast events come and however heavy they are (an attention
row per watched layer grows with the context). So one drain delivers batches for at most
DRAIN_BUDGET_S and lets the event loop paint and take input before it goes on (a batch holds as
many events as the budget left has room for, at what events have cost so far); a drain that
falls due right after the panels' frame waits for the event loop's next turn (ui.turns); and
when the undelivered events weigh more than MAX_BUFFERED_WEIGHT the receiving thread waits for
the GUI (and so, in turn, does the engine), which keeps memory bounded when the GUI is the
slower of the two (never with a model decoding at tens of tokens a second; possible with a
fast one and long attention rows).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from time import perf_counter

from PySide6.QtCore import QObject, Qt, QTimer, Signal, Slot

from app.client import full_collections
from app.server.jobs import event_weight
from engine.events import Event, PrefillDone, StepRows, Token
from ui.turns import GIVE_WAY_MS, Turns

log = logging.getLogger(__name__)

DRAIN_INTERVAL_MS = 33  # ~30 Hz: one GUI update per frame whatever the token rate
# The longest interval `set_interval` takes: 2 deliveries a second, as often as the chat view
# draws streamed text and the panels draw at their slowest (ui.chat_view.SLOWEST_STREAM_FRAME_MS,
# ui.panels.docks.SLOWEST_FRAME_MS). A window over its CPU budget draws no more often than
# that, and each delivery has a cost of its own (the engine's message, the receiving thread's
# wake-up, the listeners' calls) beside its tokens'.
SLOWEST_DRAIN_MS = 500
# Wall time one drain may spend delivering before the event loop runs again. Twice this, a busy
# machine stretched a drain and the frame queued behind it into long stalls; at this budget
# the stream is as fast and the stalls shorter.
DRAIN_BUDGET_S = 0.006
BATCH_WEIGHT = 256 * 1024  # a batch ends once it holds this much (listeners' work stays short)
# A batch holds at least this many events: each has a cost of its own (the listeners' calls),
# so batches sized by a budget nearly spent would cost more in all.
MIN_BATCH_EVENTS = 8
# What an event costs the listeners before any was timed (a token's is ~0.1 ms on a slow CPU)
FIRST_EVENT_COST_S = 1e-4
MAX_BUFFERED_WEIGHT = 8 * 2**20  # the receiving thread waits while more is undelivered

Batch = Callable[[list[Event]], None]


class Delivery(QObject):
    """The buffer between the receiving thread and the GUI thread; see the module docstring.

    `deliver(batch)` and `reached(job)` are called in the GUI thread.
    """

    _first_tokens = Signal()  # from the receiving thread: a reply's first events are here

    def __init__(
        self, deliver: Batch, reached: Callable[[int], None], parent: QObject | None = None
    ) -> None:
        super().__init__(parent)
        self._deliver = deliver
        self._reached = reached
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._buffer: deque[tuple[Event, int]] = deque()  # (event, weight)
        self._buffered_weight = 0
        self._pushed = 0  # events pushed by the receiving thread, ever
        self._delivered = 0  # events handed to the GUI thread, ever
        self._ends: deque[tuple[int, int]] = deque()  # (events pushed by its end, job)
        self._closed = False
        self.preparer: Batch | None = None  # see prepare
        self.turns = Turns()  # shared with the panels' frame (EngineClient.share_turns)
        self._event_cost = FIRST_EVENT_COST_S  # seconds the listeners took an event, lately

        self._timer = QTimer(self)
        self._timer.setInterval(DRAIN_INTERVAL_MS)
        self._timer.timeout.connect(self.drain)
        self._again = QTimer(self)  # drains on as soon as the event loop has had its turn
        self._again.setSingleShot(True)
        self._again.setInterval(GIVE_WAY_MS)
        self._again.timeout.connect(self.drain)
        # A reply's start is delivered at once, not at the next tick of a slow drain timer:
        # the time to its first token shown stays what the engine made it.
        self._first_tokens.connect(self.drain, Qt.ConnectionType.QueuedConnection)

    # -- GUI thread ----------------------------------------------------------------------------

    def set_interval(self, interval_ms: int) -> None:
        """Deliver every `interval_ms` (DRAIN_INTERVAL_MS to SLOWEST_DRAIN_MS)."""
        interval = min(max(interval_ms, DRAIN_INTERVAL_MS), SLOWEST_DRAIN_MS)
        if interval != self._timer.interval():
            self._timer.setInterval(interval)

    @property
    def interval(self) -> int:
        return self._timer.interval()

    def start(self) -> None:
        """Drain on the timer (while jobs are under way), with no full garbage collection in
        the meantime (app.client.full_collections)."""
        if not self._closed:
            self._timer.start()
            full_collections.hold(self)

    def pause(self) -> None:
        self._timer.stop()
        full_collections.release(self)

    def end_at(self, pushed: int, job: int) -> None:
        """`job` ended once `pushed` events were pushed: `reached(job)` once they are out."""
        self._ends.append((pushed, job))
        self.drain()  # now if its events are all out, else when they are

    def close(self) -> None:
        """Stop delivering; a receiving thread waiting for room goes on. Jobs not yet reached
        stay so."""
        with self._drained:
            self._closed = True
            self._drained.notify_all()
        self._timer.stop()
        self._again.stop()
        self._ends.clear()
        full_collections.release(self)

    @Slot()
    def drain(self) -> None:
        """Deliver buffered events; the timer calls this 2 to 30 times a second.

        Batches go out until the buffer is empty or DRAIN_BUDGET_S has passed; then the event
        loop gets its turn (paint, input, timers) and the rest follows right after. Right
        after the panels' frame, all of it waits for that turn.
        """
        self.turns.take(self._deliver_for_a_while, self._again.start)
        if self._buffer and not self._closed:
            self._again.start()

    def _deliver_for_a_while(self) -> None:
        """Batches until the buffer is empty or DRAIN_BUDGET_S has passed; then the jobs whose
        events are all out are reached."""
        started = perf_counter()
        while batch := self._take_batch(self._batch_events(started)):
            self._delivered += len(batch)
            before = perf_counter()
            self._deliver(batch)
            after = perf_counter()
            self._learn_cost(len(batch), after - before)
            if after - started > DRAIN_BUDGET_S:
                break
        while self._ends and self._delivered >= self._ends[0][0]:
            self._reached(self._ends.popleft()[1])

    def _batch_events(self, started: float) -> int:
        """How many events the next batch may hold: what the drain's budget left has room for."""
        left = DRAIN_BUDGET_S - (perf_counter() - started)
        return max(MIN_BATCH_EVENTS, int(left / self._event_cost))

    def _learn_cost(self, events: int, seconds: float) -> None:
        """Follow what an event costs the listeners, smoothed over the last few batches."""
        self._event_cost = 0.7 * self._event_cost + 0.3 * max(seconds / events, 1e-6)

    def _take_batch(self, most: int) -> list[Event]:
        with self._drained:
            batch: list[Event] = []
            weight = 0
            while self._buffer and weight < BATCH_WEIGHT and len(batch) < most:
                event, event_weight_ = self._buffer.popleft()
                batch.append(event)
                weight += event_weight_
            self._buffered_weight -= weight
            self._drained.notify_all()
            return batch

    # -- the receiving thread ------------------------------------------------------------------

    @property
    def pushed(self) -> int:
        with self._lock:
            return self._pushed

    def prepare(self, events: list[Event]) -> None:
        """The window's work on a batch in the receiving thread, before the GUI thread gets it
        (the panels' attention statistics: InternalsState.prepared). If it fails, it is
        dropped: the GUI thread then does that work on ingest, and the reply goes on."""
        prepare = self.preparer
        if prepare is None:
            return
        try:
            prepare(events)
        except Exception:
            log.exception("preparing events for the window failed; the window does it")
            self.preparer = None

    def push(self, events: list[Event], wait: bool = True) -> None:
        """Buffer events; waits while the GUI is far behind, unless closed or told not to (the
        GUI thread itself must never wait for itself)."""
        with self._drained:
            for event in events:
                weight = event_weight(event)
                self._buffer.append((event, weight))
                self._buffered_weight += weight
            self._pushed += len(events)
        if any(_wanted_now(event) for event in events):
            self._first_tokens.emit()
        with self._drained:
            while wait and self._buffered_weight > MAX_BUFFERED_WEIGHT and not self._closed:
                self._drained.wait(0.1)


def _wanted_now(event: Event) -> bool:
    """A reply's start, or rows the window asked for (a selected step, perhaps after the
    reply ended and the drain timer stopped): delivered now, not at a later tick."""
    if isinstance(event, StepRows):
        return not event.latest
    return isinstance(event, PrefillDone) or (isinstance(event, Token) and event.index == 0)
