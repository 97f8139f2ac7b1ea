"""The window's handle on the engine server, wherever the server runs: `EngineClient`.

Requests (app.server.wire) are sent from the GUI thread over a transport: the pipe to the engine's
child process (app.server.engine_process, what the app runs) or in-memory queues to a server thread
(app.server.engine_thread, the fast tests). A `_Receiver` QThread reads the replies, puts events
straight into the time-sliced delivery (app.client.delivery) and hands everything else to the GUI
thread as queued signals, where one `match` reads them. The server owns the jobs' state; the
client remembers only what it asked for, by job id, to know when it is busy.

Stop sends a Cancel that the server acts on as it arrives, not queued behind the reply it
stops: it takes effect within one decode step.

If the engine dies (killed, crashed, out of memory), the reply in progress ends with a Failed
saying so and a Finished with what had streamed; `engine_stopped` says it in one line, and the
next request starts a fresh engine that reloads the same model first.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.client.delivery import DRAIN_INTERVAL_MS, Delivery
from app.server import wire
from app.server.jobs import ReplyTally
from engine.events import ENGINE_STOPPED, Event, Finished, ModelInfo
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings
from ui.turns import Turns

log = logging.getLogger(__name__)

RESTART_NOTE = "a new engine starts with your next message"


@dataclass
class TransportStats:
    """What crossed from the engine: bytes, messages, and each message's time in transit."""

    messages: int = 0
    events: int = 0
    bytes: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def add(self, size: int, events: int, queued_at: float) -> None:
        self.messages += 1
        self.events += events
        self.bytes += size
        if len(self.latencies_s) < 100_000:
            self.latencies_s.append(time.monotonic() - queued_at)


class _Receiver(QThread):
    """Reads the engine's replies until its transport ends; `died()` unless told it would."""

    reply = Signal(object, int)  # a reply for the GUI thread, and the events pushed by then
    died = Signal(object)  # this receiver: a later engine's receiver is another one

    def __init__(self, engine: wire.Transport, delivery: Delivery, stats: TransportStats) -> None:
        super().__init__()
        self.setObjectName("glassbox-engine-client")
        self.engine = engine
        self.delivery = delivery
        self.stats = stats
        self.expected_end = False
        self.ready_at: float | None = None  # when the server said Ready (start-up timing)
        self.tally = ReplyTally()  # the events of the last job that sent any, so far
        self.tally_job = 0

    def run(self) -> None:
        while True:
            try:
                reply, size = self.engine.receive()
            except EOFError:
                break
            if isinstance(reply, wire.Events):  # straight into the delivery, in this thread
                self._on_events(reply, size)
                continue
            if isinstance(reply, wire.Ready):  # as it came, not when the GUI thread gets to it
                self.ready_at = time.perf_counter()
            self.reply.emit(reply, self.delivery.pushed)
        if not self.expected_end:
            self.died.emit(self)

    def _on_events(self, reply: wire.Events, size: int) -> None:
        events = list(reply.events)
        self.stats.add(size, len(events), reply.queued_at)
        if reply.job != self.tally_job:
            self.tally, self.tally_job = ReplyTally(), reply.job
        for event in events:
            self.tally.add(event)
        self.delivery.prepare(events)
        self.delivery.push(events)

    def tally_of(self, job: int) -> ReplyTally:
        """What job `job` streamed so far (nothing if it sent no events yet)."""
        return self.tally if job == self.tally_job else ReplyTally()


class EngineClient(QObject):
    """The GUI-thread handle on an engine server: the window's backend (ui.main_window.Backend).

    Signals (all delivered in the GUI thread):
      events(list[Event])   a batch of engine events, in order, at most ~30 batches a second
      loaded(ModelInfo)     a model finished loading and replaced the previous one
      load_progress(str, float)  stage name and fraction 0..1 of a load in progress
      load_failed(str)      a load failed; the previous model (if any) is still loaded
      load_proposed(LoadRequest)  just before load_failed, for a model too big for where it
                            was asked to run: the same request, placed so that it fits
      busy_changed(bool)    whether a load or a generation is queued or running
      engine_stopped(str)   the engine died (its process was killed or crashed); one line why
      decode_step(str)      after `loaded`, once a fast model's compiled decode step is in use
                            ("compiled") or will not be ("eager: why")
      tokens_counted(int, int | None)  the answer to `count_tokens`: its id, the count
      held_changed(bool)    the reply is held by a pause (True) or goes on (False); every
                            event it sent before is delivered first
      lens_ready(int, LayerLens | None)  the answer to `ask_lens`: its id, the lens
    """

    events = Signal(object)
    loaded = Signal(object)
    load_progress = Signal(str, float)
    load_failed = Signal(str)
    load_proposed = Signal(object)
    busy_changed = Signal(bool)
    engine_stopped = Signal(str)
    decode_step = Signal(str)
    tokens_counted = Signal(int, object)
    held_changed = Signal(bool)
    lens_ready = Signal(int, object)

    def __init__(self, engine: wire.Transport, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._delivery = Delivery(self._deliver, self._reached, self)
        self._ids = itertools.count(1)  # job ids, unique for this client's engines
        # sent, their end not yet delivered
        self._jobs: dict[int, wire.Load | wire.Generate] = {}
        self._reloads: set[int] = set()  # loads of the same model into a new engine
        self._reply: int | None = None  # the reply whose Finished is not yet delivered
        self._info: ModelInfo | None = None
        self._loaded_request: LoadRequest | None = None  # what a new engine reloads
        self.decode_step_state: str | None = None  # the engine's last word on it, this load
        self.restarts = 0
        self._shut_down = False
        self._transport = TransportStats()
        self._engine: wire.Transport | None = None
        self._dead: wire.Transport | None = None  # the engine that died, to start again
        self._receiver: _Receiver | None = None
        # What the panels draw of attention rows (sent again to a new engine).
        self._watch = wire.Watch()
        self._lens_watched = False  # a new engine is told again
        self._attach(engine)

    # -- state ---------------------------------------------------------------------------------

    @property
    def info(self) -> ModelInfo | None:
        """The loaded model, or None before the first successful load."""
        return self._info

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def generating(self) -> bool:
        return self._reply is not None

    @property
    def engine(self) -> wire.Transport | None:
        """The running engine, or None after it died (until the next request)."""
        return self._engine

    @property
    def transport(self) -> TransportStats:
        return self._transport

    @property
    def ready_at(self) -> float | None:
        """perf_counter() when the running engine said it was ready, if it did."""
        return self._receiver.ready_at if self._receiver is not None else None

    def is_running(self) -> bool:
        """Whether any thread or process of the engine is still running."""
        receiver = self._receiver is not None and self._receiver.isRunning()
        return receiver or (self._engine is not None and self._engine.is_alive())

    # -- delivery --------------------------------------------------------------------------------

    def share_turns(self, turns: Turns) -> None:
        """Deliver in turns of the event loop of their own beside the other heavy work that
        notes itself in `turns` (the panels' frame: ui.turns)."""
        self._delivery.turns = turns

    def set_drain_interval(self, interval_ms: int) -> None:
        """Deliver every `interval_ms` (app.client.delivery's bounds): no more often than the window
        draws what it is given. Each delivery wakes the GUI thread and costs it per batch (the
        chat view, the store, the panels' ingest); at 30 a second with the panels drawing twice
        a second, most deliveries were drawn by nothing. The engine is told too
        (wire.Cadence): it then sends a reply's tokens as often as they are delivered, and the
        receiving thread wakes as seldom."""
        before = self._delivery.interval
        self._delivery.set_interval(interval_ms)
        if self._delivery.interval != before and not self._shut_down and self._engine is not None:
            self._engine.send(self._cadence())

    def _cadence(self) -> wire.Cadence:
        return wire.Cadence(self._delivery.interval / 1000)

    @property
    def drain_interval(self) -> int:
        return self._delivery.interval

    def set_preparer(self, prepare: Callable[[list[Event]], None] | None) -> None:
        """Work to do on each batch of events in the receiving thread, before the GUI thread
        gets them (the panels' attention statistics: InternalsState.prepared)."""
        self._delivery.preparer = prepare

    @property
    def preparer(self) -> Callable[[list[Event]], None] | None:
        """The preparer, or None (never set, or dropped after it failed)."""
        return self._delivery.preparer

    # -- requests (GUI thread) -----------------------------------------------------------------

    def load(self, request: LoadRequest) -> None:
        """Load a model; a reply in progress is stopped first."""
        if self._shut_down:
            return
        if self.generating:
            self.stop()
        self.decode_step_state = None
        self._begin(wire.Load(next(self._ids), request))

    def generate(
        self,
        messages: Sequence[Message],
        settings: GenerationSettings,
        probes: ProbeSettings | None = None,
        stream: bool = True,
    ) -> bool:
        """Start a reply; False (and nothing queued) while busy, unloaded or shut down.
        `stream=False`: only its Failed and Finished come back (app.server.wire.Generate)."""
        if self._shut_down or self.busy or self._info is None:
            return False
        probes = probes if probes is not None else ProbeSettings()
        request = wire.Generate(next(self._ids), tuple(messages), settings, probes, stream)
        self._reply = request.job
        self._begin(request)
        return True

    def stop(self) -> None:
        """Cancel the reply in progress; takes effect within one decode step."""
        if self._reply is not None and self._engine is not None:
            self._engine.send(wire.Cancel(self._reply))

    def pace(self, action: str, rate: float = 0.0) -> None:
        """Pause, step (Next token), resume or play the replies at `rate` tokens a second;
        acted on as it arrives, like Stop (app.server.wire.Pace)."""
        if not self._shut_down and self._engine is not None:
            self._engine.send(wire.Pace(action, rate))

    def watch(
        self, layers: Sequence[int], interval_s: float, grid: tuple[int, int] | None = None
    ) -> None:
        """The layers whose attention rows a visible panel draws (none: no rows cross, only
        the per-token statistics), and the seconds between its frames: the engine sends the
        latest step's rows of those layers no more often than that (app.server.view_rows).
        `grid`: the cells (rows, keys) the panel's mosaic has room for, where it knows them:
        a prompt's matrix then crosses pooled near that grid, its rows later."""
        request = wire.Watch(tuple(sorted(set(layers))), max(interval_s, 0.0), grid)
        if request == self._watch:
            return
        self._watch = request
        if not self._shut_down and self._engine is not None:
            self._engine.send(request)

    @property
    def watching(self) -> wire.Watch:
        return self._watch

    def fetch(self, step: int, layers: Sequence[int] = ()) -> None:
        """Ask for step `step`'s attention rows of the latest reply: they come as a StepRows
        event (aged_out where the engine's ring no longer holds them), delivered at once."""
        if not self._shut_down and self._engine is not None:
            self._engine.send(wire.Fetch(step, tuple(layers)))

    def fetch_prompt(self) -> None:
        """Ask for the prompt's rows of the layers whose matrix crossed pooled: they come as a
        StepRows event with `prompt` (aged_out where the ring no longer holds them)."""
        if not self._shut_down and self._engine is not None:
            self._engine.send(wire.Fetch(0, prompt=True))

    def watch_lens(self, on: bool) -> None:
        """Have the engine keep each step's per-layer residuals (a visible Layers panel), or
        not; acted on as it arrives (app.server.wire.WatchLens)."""
        self._lens_watched = on
        if not self._shut_down and self._engine is not None:
            self._engine.send(wire.WatchLens(on))

    def ask_lens(self, step: int, top: int = 10) -> int | None:
        """Ask for the latest reply's step `step` through each layer's eyes; answered as
        `lens_ready` with the id returned (None: no engine to ask)."""
        if self._shut_down or self._engine is None:
            return None
        request = wire.AskLens(next(self._ids), step, top)
        self._engine.send(request)
        return request.job

    def reset(self) -> None:
        """Forget the session's KV cache (new chat); runs after any job already queued."""
        if not self._shut_down and self._engine is not None:  # a new engine starts empty
            self._engine.send(wire.Reset(next(self._ids)))

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Ask how many tokens `messages` take; answered in order as `tokens_counted`."""
        request = wire.Count(next(self._ids), tuple(messages))
        self._send(request)
        return request.job

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Cancel, stop the engine and wait for it; safe to call more than once."""
        if self._shut_down:
            return
        self._shut_down = True
        self._delivery.close()  # a receiving thread waiting for the GUI goes on
        self.stop()
        self._close_engine(timeout_s)
        self._jobs.clear()
        self._reply = None

    # -- sending -------------------------------------------------------------------------------

    def _begin(self, request: wire.Load | wire.Generate) -> None:
        self._jobs[request.job] = request
        if len(self._jobs) == 1:
            self._delivery.start()
            self.busy_changed.emit(True)
        self._send(request)

    def _send(self, request: wire.Request) -> None:
        if self._engine is None:
            # a new model needs no old one
            self._restart(reload=not isinstance(request, wire.Load))
        assert self._engine is not None  # attached above if it was not
        if not self._engine.send(request):
            log.warning("the engine's channel is closed; its end will be reported")

    def _restart(self, reload: bool) -> None:
        """A fresh engine after the last one died, loading the model the old one had."""
        assert self._dead is not None  # kept by _on_died: the engine to start again
        self.restarts += 1
        engine = self._dead.again()
        self._attach(engine)
        if reload and self._info is not None and self._loaded_request is not None:
            self.load_progress.emit(f"Starting a new engine with {self._info.name}", 0.0)
            request = wire.Load(next(self._ids), self._loaded_request)
            self._reloads.add(request.job)
            self._begin(request)

    def _attach(self, engine: wire.Transport) -> None:
        self._engine, self._dead = engine, None
        self._receiver = _Receiver(engine, self._delivery, self._transport)
        self._receiver.reply.connect(self._on_reply)
        self._receiver.died.connect(self._on_died)
        self._receiver.start()
        if self._watch != wire.Watch():
            engine.send(self._watch)
        if self._delivery.interval != DRAIN_INTERVAL_MS:
            engine.send(self._cadence())
        if self._lens_watched:
            engine.send(wire.WatchLens(True))

    # -- replies (GUI thread) --------------------------------------------------------------------

    @Slot(object, int)
    def _on_reply(self, reply: wire.Reply, pushed: int) -> None:
        if self._shut_down:
            return
        match reply:
            case wire.Progress(stage=stage, fraction=fraction):
                self.load_progress.emit(stage, fraction)
            case wire.Loaded(job=job, info=info):
                self._on_loaded(job, info)
            case wire.LoadFailed(message=message, fits_as=fits_as):
                if fits_as is not None:
                    self.load_proposed.emit(fits_as)
                self.load_failed.emit(message)
            case wire.DecodeStep(state=state):
                self.decode_step_state = state
                self.decode_step.emit(state)
            case wire.Counted(job=job, tokens=tokens):
                self.tokens_counted.emit(job, tokens)
            case wire.Lensed(job=job, lens=lens):
                self.lens_ready.emit(job, lens)
            case wire.Held(job=job, held=held) if job in self._jobs:
                # A stepped token is shown now, not at the next tick of the drain timer.
                self._delivery.drain()
                self.held_changed.emit(held)
            case wire.Done(job=job) if job in self._jobs:
                self._delivery.end_at(pushed, job)
            case (
                wire.Ready() | wire.Done() | wire.Events() | wire.Held()
            ):  # Ready: timed by the receiver
                pass

    def _on_loaded(self, job: int, info: ModelInfo) -> None:
        self._info = info
        if job in self._reloads:  # the same model back in a new engine: nothing changed
            return
        request = self._jobs.get(job)
        if isinstance(request, wire.Load):
            self._loaded_request = request.request
        self.loaded.emit(info)

    def _deliver(self, batch: list[Event]) -> None:
        if any(isinstance(event, Finished) for event in batch):
            self._reply = None
        self.events.emit(batch)

    def _reached(self, job: int) -> None:
        """Every event of `job` is delivered: it ends for the window."""
        if self._jobs.pop(job, None) is None:
            return
        self._reloads.discard(job)
        if job == self._reply:
            self._reply = None
        if not self._jobs:
            self._delivery.pause()
            self.busy_changed.emit(False)

    @Slot(object)
    def _on_died(self, dead: _Receiver) -> None:
        receiver, engine = self._receiver, self._engine
        if self._shut_down or engine is None or dead is not receiver:
            return
        reason = engine.why_stopped()
        receiver.wait()
        engine.close()
        self._engine, self._receiver, self._dead = None, None, engine
        log.error("%s", reason)
        cut = list(self._jobs.values())
        self.engine_stopped.emit(f"{reason}: {RESTART_NOTE}.")  # before the reply it cut ends
        for request in cut:
            self._end_cut_job(request, reason, receiver.tally_of(request.job))

    def _end_cut_job(
        self, request: wire.Load | wire.Generate, reason: str, tally: ReplyTally
    ) -> None:
        if isinstance(request, wire.Load):
            self.load_failed.emit(f"{reason} while loading the model")
        else:
            line = f"{reason}; the reply was cut here and {RESTART_NOTE}."
            self._delivery.push(tally.cut_off(line, ENGINE_STOPPED), wait=False)
        self._delivery.end_at(self._delivery.pushed, request.job)

    def _close_engine(self, timeout_s: float) -> None:
        receiver, engine = self._receiver, self._engine
        if receiver is not None:
            receiver.expected_end = True
        if engine is not None:
            # Importing or loading cannot be interrupted and loses nothing if cut: no waiting.
            importing = receiver is None or receiver.ready_at is None
            loading = any(isinstance(request, wire.Load) for request in self._jobs.values())
            engine.stop(max(timeout_s, 5.0), patient=not (importing or loading))
        if receiver is not None:
            receiver.wait()
        if engine is not None:
            engine.close()
        self._engine, self._receiver = None, None
