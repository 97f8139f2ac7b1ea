"""Runs model loading and generation off the GUI thread and hands the events back to it.

`WorkerBase` is the GUI-thread face of the engine, whichever way the engine runs: in a process
of its own (app.engine_client.EngineProcessWorker, what the window uses) or in a thread of
this process (`GenerationWorker` below, for tests and anything that injects its own loader or
session). Requests (load, generate, reset) run one at a time, in order. Only `stop()` bypasses
that order: it reaches the running session's cancel flag directly, so a reply stops within
one decode step even though the engine is busy inside it.

Events are not sent as one queued signal per token: at hundreds of tokens per second that floods
the GUI event loop. A receiving thread appends them to a locked buffer instead, and a GUI-thread
QTimer drains it about 30 times a second, emitting batches as `events` (and each event as
`event_delivered`). A job's end is signalled with the number of events pushed by then, and
`busy_changed(False)` waits until that many were delivered: listeners see `Finished` first.

The GUI must stay responsive however fast events come and however heavy they are (an attention
row per watched layer grows with the context). So one drain delivers batches for at most
DRAIN_BUDGET_S and lets the event loop paint and take input before it goes on; and when the
undelivered events weigh more than MAX_BUFFERED_WEIGHT the receiving thread waits for the GUI
(and so, in turn, does the engine), which keeps memory bounded when the GUI is the slower of
the two (never with a model decoding at tens of tokens a second; possible with a fast one and
long attention rows).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal, Slot

from app.jobs import (
    Loader,
    Session,
    SessionFactory,
    default_loader,
    default_session_factory,
    describe_error,
    event_weight,
    load_session,
    run_generation,
)
from engine.events import Event, Finished, ModelInfo, PrefillDone, Token
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

log = logging.getLogger(__name__)

DRAIN_INTERVAL_MS = 33  # ~30 Hz: one GUI update per frame whatever the token rate
# The longest interval `set_drain_interval` takes: 10 deliveries a second, as often as the
# chat view draws streamed text (ui.chat_view.STREAM_FRAME_MS).
SLOWEST_DRAIN_MS = 100
# Wall time one drain may spend delivering before the event loop runs again. At 12 ms, a busy
# machine stretched a drain and the frame queued behind it past 60 ms at the 99th percentile
# of a 10,000-token stream; at 6 ms the stream is as fast and the p99 stall ~45 ms.
DRAIN_BUDGET_S = 0.006
BATCH_WEIGHT = 256 * 1024  # a batch ends once it holds this much (listeners take ~2 ms)
MAX_BUFFERED_WEIGHT = 8 * 2**20  # the receiving thread waits while more is undelivered

__all__ = [
    "GenerationWorker",
    "Session",
    "WorkerBase",
    "describe_error",
    "event_weight",
]


class WorkerBase(QObject):
    """The GUI-thread handle on the engine: job bookkeeping and time-sliced delivery.

    Signals (all delivered in the GUI thread):
      events(list[Event])   a batch of engine events, in order, at most ~30 batches a second
      event_delivered(Event)  each of those events, one by one, right after its batch
      loaded(ModelInfo)     a model finished loading and replaced the previous one
      load_progress(str, float)  stage name and fraction 0..1 of a load in progress
      load_failed(str)      a load failed; the previous model (if any) is still loaded
      busy_changed(bool)    whether a load or a generation is queued or running
      engine_stopped(str)   the engine died (its process was killed or crashed); one line why
      decode_step(str)      after `loaded`, once a fast model's compiled decode step is in use
                            ("compiled") or will not be ("eager: why")

    Subclasses carry requests to the engine (`_send_*`) and feed back what it says through
    `_push` (events, from any thread), `loaded`/`load_progress`/`load_failed` and
    `_on_job_done(pushed)` (GUI thread).
    """

    events = Signal(object)
    event_delivered = Signal(object)  # each event as it is delivered (not QObject.event)
    loaded = Signal(object)
    load_progress = Signal(str, float)
    load_failed = Signal(str)
    busy_changed = Signal(bool)
    engine_stopped = Signal(str)
    decode_step = Signal(str)
    _first_tokens = Signal()  # from the receiving thread: a reply's first events are here

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._buffer: deque[tuple[Event, int]] = deque()  # (event, weight)
        self._buffered_weight = 0
        self._pushed = 0  # events pushed by the receiving thread, ever
        self._delivered = 0  # events emitted in the GUI thread, ever
        self._job_ends: deque[int] = deque()  # per finished job: events pushed by its end
        self._pending_jobs = 0
        self._generating = False
        self._job = 0
        self._cancelled_upto = 0
        self._info: ModelInfo | None = None
        self._shut_down = False
        self.preparer: Callable[[list[Event]], None] | None = None  # see set_preparer

        self._timer = QTimer(self)
        self._timer.setInterval(DRAIN_INTERVAL_MS)
        self._timer.timeout.connect(self.drain)
        self._again = QTimer(self)  # drains on as soon as the event loop has had its turn
        self._again.setSingleShot(True)
        self._again.setInterval(0)
        self._again.timeout.connect(self.drain)
        # A reply's start is delivered at once, not at the next tick of a slow drain timer:
        # the time to its first token shown stays what the engine made it.
        self._first_tokens.connect(self.drain, Qt.ConnectionType.QueuedConnection)

    def set_drain_interval(self, interval_ms: int) -> None:
        """Deliver every `interval_ms` (DRAIN_INTERVAL_MS to SLOWEST_DRAIN_MS): no more often
        than the window draws what it is given. Each delivery wakes the GUI thread and costs
        it per batch (the chat view, the store, the panels' ingest); at 30 a second with the
        panels drawing twice a second, most deliveries were drawn by nothing."""
        interval = min(max(interval_ms, DRAIN_INTERVAL_MS), SLOWEST_DRAIN_MS)
        if interval != self._timer.interval():
            self._timer.setInterval(interval)

    @property
    def drain_interval(self) -> int:
        return self._timer.interval()

    def set_preparer(self, prepare: Callable[[list[Event]], None] | None) -> None:
        """Work to do on each batch of events in the thread that receives them, before the GUI
        thread gets them (the panels' attention statistics: InternalsState.prepared).

        Only a worker whose receiving thread is not the model's does it (the engine process's
        client): the in-process worker's events come from the thread that runs the model,
        which must not wait for the window's work, so there the GUI thread does it on ingest.
        """
        self.preparer = prepare

    # -- state -------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model, or None before the first successful load."""
        return self._info

    @property
    def busy(self) -> bool:
        return self._pending_jobs > 0

    @property
    def generating(self) -> bool:
        return self._generating

    def is_running(self) -> bool:
        """Whether any thread (or process) of the engine is still running."""
        raise NotImplementedError

    # -- requests (GUI thread) -----------------------------------------------------------------

    def load(self, request: LoadRequest) -> None:
        """Load a model; a reply in progress is stopped first."""
        if self._shut_down:
            return
        if self._generating:
            self.stop()
        self._begin_job()
        self._send_load(request)

    def generate(
        self,
        messages: Sequence[Message],
        settings: GenerationSettings,
        probes: ProbeSettings | None = None,
    ) -> bool:
        """Start a reply; False (and nothing queued) while busy, unloaded or shut down."""
        if self._shut_down or self.busy or self._info is None:
            return False
        self._job += 1
        self._generating = True
        self._begin_job()
        probes = probes if probes is not None else ProbeSettings()
        self._send_generate(self._job, tuple(messages), settings, probes)
        return True

    def stop(self) -> None:
        """Cancel the reply in progress; takes effect within one decode step."""
        if not self._generating:
            return
        self._cancelled_upto = self._job
        self._send_stop(self._job)

    def reset(self) -> None:
        """Forget the session's KV cache (new chat); runs after any job already queued."""
        if not self._shut_down:
            self._send_reset()

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Cancel, stop the engine and wait for it; safe to call more than once."""
        if self._shut_down:
            return
        with self._drained:
            self._shut_down = True  # a receiving thread waiting for the GUI goes on
            self._drained.notify_all()
        self.stop()
        self._timer.stop()
        self._again.stop()
        self._close_engine(timeout_s)
        self._pending_jobs = 0
        self._job_ends.clear()
        self._generating = False

    # -- what subclasses provide ---------------------------------------------------------------

    def _send_load(self, request: LoadRequest) -> None:
        raise NotImplementedError

    def _send_generate(
        self,
        job: int,
        messages: tuple[Message, ...],
        settings: GenerationSettings,
        probes: ProbeSettings,
    ) -> None:
        raise NotImplementedError

    def _send_stop(self, job: int) -> None:
        raise NotImplementedError

    def _send_reset(self) -> None:
        raise NotImplementedError

    def _close_engine(self, timeout_s: float) -> None:
        raise NotImplementedError

    # -- plumbing ------------------------------------------------------------------------------

    def _begin_job(self) -> None:
        self._pending_jobs += 1
        if self._pending_jobs == 1:
            self._timer.start()
            self.busy_changed.emit(True)

    def _push(self, events: list[Event], wait: bool = True) -> None:
        """Buffer events (receiving thread); waits while the GUI is far behind, unless
        stopping or told not to (the GUI thread itself must never wait for itself)."""
        with self._drained:
            for event in events:
                weight = event_weight(event)
                self._buffer.append((event, weight))
                self._buffered_weight += weight
            self._pushed += len(events)
        if any(_starts_reply(event) for event in events):
            self._first_tokens.emit()
        with self._drained:
            while wait and self._buffered_weight > MAX_BUFFERED_WEIGHT and not self._stopping():
                self._drained.wait(0.1)

    def _stopping(self) -> bool:
        return self._shut_down or self._cancelled_upto >= self._job

    def _pushed_count(self) -> int:
        with self._lock:
            return self._pushed

    def _take_batch(self) -> list[Event]:
        with self._drained:
            batch: list[Event] = []
            weight = 0
            while self._buffer and weight < BATCH_WEIGHT:
                event, event_weight_ = self._buffer.popleft()
                batch.append(event)
                weight += event_weight_
            self._buffered_weight -= weight
            self._drained.notify_all()
            return batch

    @Slot()
    def drain(self) -> None:
        """Deliver buffered events (GUI thread); the timer calls this ~30 times a second.

        Batches go out until the buffer is empty or DRAIN_BUDGET_S has passed; then the event
        loop gets its turn (paint, input, timers) and the rest follows right after.
        """
        started = time.perf_counter()
        while batch := self._take_batch():
            self._delivered += len(batch)
            if any(isinstance(event, Finished) for event in batch):
                self._generating = False
            self.events.emit(batch)
            for event in batch:
                self.event_delivered.emit(event)
            if time.perf_counter() - started > DRAIN_BUDGET_S:
                break
        self._end_delivered_jobs()
        if self._buffer and not self._shut_down:
            self._again.start()

    def _end_delivered_jobs(self) -> None:
        while self._job_ends and self._delivered >= self._job_ends[0]:
            self._job_ends.popleft()
            if self._pending_jobs == 0:  # shut down meanwhile
                continue
            self._pending_jobs -= 1
            if self._pending_jobs == 0:
                self._timer.stop()
                self._generating = False
                self.busy_changed.emit(False)

    @Slot(object)
    def _on_loaded(self, info: ModelInfo) -> None:
        self._info = info
        self.loaded.emit(info)

    @Slot(int)
    def _on_job_done(self, pushed: int) -> None:
        if self._pending_jobs == 0:  # shut down meanwhile
            return
        self._job_ends.append(pushed)
        self.drain()  # ends the job now if its events are all out, else when they are


def _starts_reply(event: Event) -> bool:
    return isinstance(event, PrefillDone) or (isinstance(event, Token) and event.index == 0)


class _Runner(QObject):
    """Lives in the worker thread; every slot runs there."""

    loaded = Signal(object)
    load_progress = Signal(str, float)
    load_failed = Signal(str)
    job_done = Signal(int)  # how many events had been pushed when the job ended

    def __init__(self, loader: Loader, session_factory: SessionFactory, worker: WorkerBase) -> None:
        super().__init__()
        self._loader = loader
        self._session_factory = session_factory
        self._worker = worker
        self.session: Session | None = None  # read by the GUI thread only to call cancel()

    @Slot(object)
    def load(self, request: LoadRequest) -> None:
        try:
            session = load_session(
                self._loader, self._session_factory, request, self.load_progress.emit
            )
        except Exception as error:
            # The previous session stays in place, so the old model keeps working.
            log.exception("loading %r failed", request.spec)
            self.load_failed.emit(describe_error(error))
        else:
            self.session = session
            self.loaded.emit(session.info)
        finally:
            self.job_done.emit(self._worker._pushed_count())

    @Slot(int, object, object, object)
    def generate(
        self,
        job: int,
        messages: Sequence[Message],
        settings: GenerationSettings,
        probes: ProbeSettings,
    ) -> None:
        worker = self._worker
        try:
            run_generation(
                self.session,
                messages,
                settings,
                probes,
                worker._push,
                lambda: job <= worker._cancelled_upto,
            )
        finally:
            self.job_done.emit(worker._pushed_count())

    @Slot()
    def reset(self) -> None:
        try:
            if self.session is not None:
                self.session.reset()
        except Exception:
            log.exception("resetting the session failed")


class GenerationWorker(WorkerBase):
    """The engine in a QThread of this process, on the loader and session factory given.

    The window runs the engine in a process of its own (app.engine_client); this in-process
    form serves the tests, which inject fake sessions and loaders, and tools that already
    hold the model in this process.
    """

    _load_requested = Signal(object)
    _generate_requested = Signal(int, object, object, object)
    _reset_requested = Signal()

    def __init__(
        self,
        loader: Loader | None = None,
        session_factory: SessionFactory | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._thread = QThread()
        self._thread.setObjectName("glassbox-model")
        self._runner = _Runner(
            loader or default_loader, session_factory or default_session_factory, self
        )
        self._runner.moveToThread(self._thread)
        self._load_requested.connect(self._runner.load)
        self._generate_requested.connect(self._runner.generate)
        self._reset_requested.connect(self._runner.reset)
        self._runner.loaded.connect(self._on_loaded)
        self._runner.load_progress.connect(self.load_progress)
        self._runner.load_failed.connect(self.load_failed)
        self._runner.job_done.connect(self._on_job_done)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread.isRunning()

    def _send_load(self, request: LoadRequest) -> None:
        self._load_requested.emit(request)

    def _send_generate(
        self,
        job: int,
        messages: tuple[Message, ...],
        settings: GenerationSettings,
        probes: ProbeSettings,
    ) -> None:
        self._generate_requested.emit(job, messages, settings, probes)

    def _send_stop(self, job: int) -> None:
        session = self._runner.session
        if session is not None:
            session.cancel()

    def _send_reset(self) -> None:
        self._reset_requested.emit()

    def _close_engine(self, timeout_s: float) -> None:
        self._thread.quit()
        if not self._thread.wait(int(timeout_s * 1000)):
            # A load cannot be interrupted; leaving the thread running would crash at exit.
            log.warning("waiting for the model thread to finish its current job")
            self._thread.wait()
