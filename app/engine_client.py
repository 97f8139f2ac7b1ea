"""The window's engine: a child process (app.engine_process) and the QThread that listens to it.

`EngineProcessWorker` has the same face as the in-process worker (app.worker.WorkerBase: the
window's Backend), so the window does not know where the model runs. Requests are written to
the child's pipe from the GUI thread; a `_Receiver` QThread reads the child's replies, puts
events straight into the time-sliced delivery buffer and hands everything else to the GUI
thread as queued signals.

If the child dies (killed, crashed, out of memory), the reply in progress ends with a Failed
saying so and a Finished with what had streamed; `engine_stopped` says it in one line, and the
next request starts a fresh child that reloads the same model first.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.engine_process import EngineProcess, EngineSpec
from app.jobs import ReplyTally
from app.worker import WorkerBase
from engine.events import ENGINE_STOPPED, Event, Finished, ModelInfo
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

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
    """Reads the child's replies until its pipe closes; `died()` unless told it would."""

    reply = Signal(object)  # (kind, *fields, job kind at the head when it arrived)
    died = Signal(object)  # this receiver: a later engine's receiver is another one

    def __init__(self, engine: EngineProcess, worker: EngineProcessWorker) -> None:
        super().__init__()
        self.setObjectName("glassbox-engine-client")
        self.engine = engine
        self.worker = worker
        self.expected_end = False
        self.tally = ReplyTally()
        self.ready_at: float | None = None

    def run(self) -> None:
        worker = self.worker
        while True:
            try:
                message, size = self.engine.receive()
            except EOFError:
                break
            kind = message[0]
            if kind == "events":
                worker._transport.add(size, len(message[2]), message[1])
                self._on_events(message[2])
            elif kind == "done":
                self.reply.emit(("done", worker._pushed_count(), worker._end_job()))
                self.tally = ReplyTally()
            elif kind == "ready":
                self.ready_at = time.perf_counter()
            else:
                self.reply.emit((*message, worker._current_job()))
        if not self.expected_end:
            self.died.emit(self)

    def _on_events(self, events: list[Event]) -> None:
        if self.worker._current_job() == "headless":
            for event in events:
                if isinstance(event, Finished):
                    self.reply.emit(("headless", event, "headless"))
            return
        for event in events:
            self.tally.add(event)
        self._prepare(events)
        self.worker._push(events)

    def _prepare(self, events: list[Event]) -> None:
        """The worker's preparer, here beside the GUI thread; if it fails, the GUI thread
        does that work on ingest instead, and the reply goes on."""
        prepare = self.worker.preparer
        if prepare is None:
            return
        try:
            prepare(events)
        except Exception:
            log.exception("preparing events for the window failed; the window does it")
            self.worker.preparer = None


class EngineProcessWorker(WorkerBase):
    """The engine in a child process: the window's backend.

    Extra signals: `headless_finished(Finished)` ends a `generate_headless` reply (benchmarks);
    `tokens_counted(ident, tokens)` answers `count_tokens`; `engine_stopped(str)`.
    """

    headless_finished = Signal(object)
    tokens_counted = Signal(int, object)

    def __init__(
        self,
        engine: EngineProcess | None = None,
        spec: EngineSpec | None = None,
        parent: QObject | None = None,
    ) -> None:
        super().__init__(parent)
        self._spec = (engine.spec if engine else spec) or EngineSpec()
        self._jobs_lock = threading.Lock()
        self._jobs: deque[str] = deque()  # kinds of the jobs sent and not yet done, in order
        self._transport = TransportStats()
        self._loads: deque[LoadRequest] = deque()  # requested, neither loaded nor failed yet
        self.decode_step_state: str | None = None  # the engine's last word on it, this load
        self._loaded_request: LoadRequest | None = None  # what a new engine reloads
        self._counts = 0
        self.restarts = 0
        self._engine: EngineProcess | None = None
        self._receiver: _Receiver | None = None
        self._attach(engine or EngineProcess(self._spec))

    # -- state ---------------------------------------------------------------------------------

    @property
    def engine(self) -> EngineProcess | None:
        """The running child, or None after it died (until the next request)."""
        return self._engine

    @property
    def transport(self) -> TransportStats:
        return self._transport

    def is_running(self) -> bool:
        receiver = self._receiver is not None and self._receiver.isRunning()
        child = self._engine is not None and self._engine.process.is_alive()
        return receiver or child

    # -- requests --------------------------------------------------------------------------------

    def generate_headless(
        self, messages: Sequence[Message], settings: GenerationSettings, probes: ProbeSettings
    ) -> bool:
        """Run a reply in the engine whose events stay there: only its Finished comes back,
        as `headless_finished` (the benchmark's reference for the window's own replies)."""
        if self._shut_down or self.busy or self._info is None:
            return False
        self._job += 1
        self._begin_job()
        self._send(("generate", self._job, tuple(messages), settings, probes, False), "headless")
        return True

    def count_tokens(self, messages: Sequence[Message]) -> int:
        """Ask how many tokens `messages` take; answered in order as `tokens_counted`."""
        self._counts += 1
        self._send(("count", self._counts, tuple(messages)), None)
        return self._counts

    def _send_load(self, request: LoadRequest) -> None:
        self.decode_step_state = None
        self._loads.append(request)
        self._send(("load", request), "load")

    def _send_generate(
        self,
        job: int,
        messages: tuple[Message, ...],
        settings: GenerationSettings,
        probes: ProbeSettings,
    ) -> None:
        self._send(("generate", job, messages, settings, probes, True), "generate")

    def _send_stop(self, job: int) -> None:
        if self._engine is not None:
            self._engine.send(("cancel", job))

    def _send_reset(self) -> None:
        if self._engine is not None:  # a new engine starts with an empty cache anyway
            self._engine.send(("reset",))

    def _send(self, message: tuple[object, ...], job_kind: str | None) -> None:
        if self._engine is None:
            self._restart(reload=job_kind != "load")  # a new model needs no old one first
        if job_kind is not None:
            with self._jobs_lock:
                self._jobs.append(job_kind)
        assert self._engine is not None  # attached above if it was not
        if not self._engine.send(message):
            log.warning("the engine's pipe is closed; its end will be reported")

    def _restart(self, reload: bool) -> None:
        """A fresh child after the last one died, loading the model the old one had."""
        self.restarts += 1
        engine = EngineProcess(self._spec)
        self._attach(engine)
        if reload and self._info is not None and self._loaded_request is not None:
            self.load_progress.emit(f"Starting a new engine with {self._info.name}", 0.0)
            self._begin_job()
            with self._jobs_lock:
                self._jobs.append("reload")
            engine.send(("load", self._loaded_request))

    def _attach(self, engine: EngineProcess) -> None:
        self._engine = engine
        self._receiver = _Receiver(engine, self)
        self._receiver.reply.connect(self._on_reply)
        self._receiver.died.connect(self._on_died)
        self._receiver.start()

    # -- the job queue (both threads) ------------------------------------------------------------

    def _current_job(self) -> str | None:
        with self._jobs_lock:
            return self._jobs[0] if self._jobs else None

    def _end_job(self) -> str | None:
        with self._jobs_lock:
            return self._jobs.popleft() if self._jobs else None

    # -- replies (GUI thread) -------------------------------------------------------------------

    @Slot(object)
    def _on_reply(self, message: tuple[Any, ...]) -> None:  # unpickled from the pipe
        if self._shut_down:
            return
        kind, *fields, job = message
        if kind == "progress":
            self.load_progress.emit(*fields)
        elif kind == "loaded":
            if job == "load" and self._loads:
                self._loaded_request = self._loads.popleft()
            self._on_model(fields[0], announce=job != "reload")
        elif kind == "load_failed":
            if job == "load" and self._loads:
                self._loads.popleft()
            self.load_failed.emit(fields[0])
        elif kind == "done":
            self._on_job_done(fields[0])
        elif kind == "headless":
            self.headless_finished.emit(fields[0])
        elif kind == "count":
            self.tokens_counted.emit(*fields)
        elif kind == "decode_step":
            self.decode_step_state = fields[0]
            self.decode_step.emit(fields[0])

    def _on_model(self, info: ModelInfo, announce: bool) -> None:
        if announce:
            self._on_loaded(info)
        else:  # the same model back in a new engine: nothing changed for the window
            self._info = info

    @Slot(object)
    def _on_died(self, dead: _Receiver) -> None:
        receiver, engine = self._receiver, self._engine
        if self._shut_down or engine is None or dead is not receiver:
            return
        reason = engine.why_stopped()
        receiver.wait()
        engine.close_pipes()
        self._engine, self._receiver = None, None
        log.error("%s", reason)
        with self._jobs_lock:
            cut, self._jobs = list(self._jobs), deque()
        self._loads.clear()
        self.engine_stopped.emit(f"{reason}: {RESTART_NOTE}.")  # before the reply it cut ends
        for kind in cut:
            self._end_cut_job(kind, reason, receiver.tally)

    def _end_cut_job(self, kind: str, reason: str, tally: ReplyTally) -> None:
        if kind in ("load", "reload"):
            self.load_failed.emit(f"{reason} while loading the model")
        elif kind == "generate":
            line = f"{reason}; the reply was cut here and {RESTART_NOTE}."
            self._push(tally.cut_off(line, ENGINE_STOPPED), wait=False)
        elif kind == "headless":
            self.headless_finished.emit(None)
        self._on_job_done(self._pushed_count())

    def _close_engine(self, timeout_s: float) -> None:
        receiver, engine = self._receiver, self._engine
        if receiver is not None:
            receiver.expected_end = True
        if engine is not None:
            # Importing or loading cannot be interrupted and loses nothing if cut: no waiting.
            importing = receiver is None or receiver.ready_at is None
            loading = self._current_job() in ("load", "reload")
            engine.stop(0.5 if importing or loading else max(timeout_s, 5.0))
        if receiver is not None:
            receiver.wait()
        if engine is not None:
            engine.close_pipes()
        self._engine, self._receiver = None, None


def start_engine(spec: EngineSpec | None = None) -> EngineProcess:
    """Spawn the engine now (Qt-free): call it first thing, so torch imports while the window
    is being built, then hand it to EngineProcessWorker."""
    return EngineProcess(spec)
