"""The engine server: runs the client's requests (app.server.wire) against one chat session, and is
the only owner of job state (which job runs, which were cancelled).

The same server runs in the engine's child process over a pipe (`serve`, the app's path) and in
a thread of the client's process over in-memory queues (app.server.engine_thread, the fast tests).

Three threads: the main one runs jobs in order; a listener reads requests and acts on Cancel
and Quit at once, so Stop reaches the session within one decode step and is never queued
behind the reply it stops (a count is answered in order: the tokenizer is not shared between
threads); a sender writes replies, so a reply never waits on the client's reader, and
coalesces the events waiting into one message (app.server.outbox). Each event crosses once.
Attention rows cross as the client pulls them (app.server.view_rows): a visible panel's latest at
its frame rate, a chosen step's from the session's ring on request; per token only their statistics.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import pickle
import queue
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from app import collector
from app.server.engine_spec import EngineSpec
from app.server.jobs import (
    Loader,
    Session,
    SessionFactory,
    describe_error,
    event_weight,
    explained,
    load_session,
    proposed_request,
    run_generation,
)
from app.server.outbox import Outbox, Write
from app.server.pipe import send_message, widen_pipe
from app.server.shared_arrays import SharedFolder
from app.server.view_rows import ViewRows, ring_of
from app.server.wire import (
    ALL_JOBS,
    AskLens,
    Cadence,
    Cancel,
    Count,
    Counted,
    DecodeStep,
    Done,
    Events,
    Fetch,
    Generate,
    Held,
    Lensed,
    Load,
    Loaded,
    LoadFailed,
    Pace,
    Progress,
    Quit,
    Ready,
    Reply,
    Request,
    Reset,
    Watch,
    WatchLens,
)
from engine.events import Event, Failed, Finished, PrefillDone

if TYPE_CHECKING:
    from engine.settings import LoadRequest, Message

log = logging.getLogger(__name__)

Job = Load | Generate | Reset | Count | AskLens


@dataclass(frozen=True)
class Threads:
    """torch's intra-op threads for each phase of a reply (see EngineSpec)."""

    prefill: int
    decode: int

    @classmethod
    def of(cls, spec: EngineSpec, cores: int, logical: int) -> Threads:
        """`cores`: torch's own default (one per physical core); `logical`: os.cpu_count().
        Spec first, then (beside a window) $GLASSBOX_PREFILL_THREADS /
        $GLASSBOX_ENGINE_THREADS. By default, beside a window on more than two cores,
        decoding leaves it a core: one of its own, or a second hardware thread where cores
        have two (EngineSpec.threads says why)."""
        if not spec.beside_window:  # the terminal chat's: torch's own default, as it runs
            return cls(prefill=spec.prefill_threads or cores, decode=spec.threads or cores)
        decode = spec.threads or _from_environment("GLASSBOX_ENGINE_THREADS")
        prefill = spec.prefill_threads or _from_environment("GLASSBOX_PREFILL_THREADS")
        leave_one = cores > 2
        spare = max(1, min(cores, logical - 1)) if leave_one else cores
        return cls(prefill=prefill or cores, decode=decode or spare)


def _from_environment(name: str) -> int:
    """A positive thread count from $name, else 0 (unset or not a count: said in the log)."""
    text = os.environ.get(name, "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    if text:
        log.warning("%s=%r is not a positive number of threads: the default is used", name, text)
    return 0


QUIT_JOIN_S = 5.0  # how long quitting waits for a decode-step recording under way


def stop_background(session: Any, timeout: float | None) -> None:
    """Stop a session's background decode-step work (the static step's recordings of its
    buckets: the queued ones dropped, the one under way joined within `timeout`)."""
    close = getattr(getattr(session, "compiling", None), "close", None)
    if close is not None:
        close(timeout)


def resolve(name: str) -> Callable[..., Any]:
    module, _, attribute = name.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
    return found


def serve(
    requests: Connection,
    replies: Connection,
    spec: EngineSpec,
    shared: SharedFolder | None = None,
) -> None:
    """The child's main function: import, then run requests until Quit or the GUI is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in a terminal is the window's to handle
    logging.basicConfig(level=logging.WARNING, format="engine %(levelname)s %(name)s: %(message)s")
    widen_pipe(replies)
    with collector.paused():
        for name in spec.preload:
            importlib.import_module(name)
        gc.freeze()  # what the imports made lives as long as the process: see app.collector
    threads = None
    torch = sys.modules.get("torch")
    if torch is not None:
        threads = Threads.of(spec, torch.get_num_threads(), os.cpu_count() or 1)
        torch.set_num_threads(threads.decode)  # a compiled decode step is built for it

    def write(reply: Reply, _weight: int) -> None:
        send_message(replies, reply, shared)

    def receive() -> Request:
        request: Request = pickle.loads(requests.recv_bytes())
        return request

    server = EngineServer(write, resolve(spec.loader), resolve(spec.session_factory), threads)
    try:
        server.serve(receive)
    finally:
        replies.close()


class EngineServer:
    """Jobs in order on one session; Cancel and Quit as they arrive. See the module docstring."""

    def __init__(
        self,
        write: Write,
        loader: Loader,
        session_factory: SessionFactory,
        threads: Threads | None = None,
    ) -> None:
        self.outbox = Outbox(write)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.session: Session | None = None
        self.threads = threads  # None: torch's own (a server in the client's process)
        self._loader = loader
        self._session_factory = session_factory
        self._lock = threading.Lock()
        self._cancelled_upto = 0
        self._running_job = 0
        self._reply_job = 0  # the latest Generate's: a Fetch is answered as its events
        self.rows = ViewRows(self.outbox.put)  # what crosses of attention rows (view_rows.py)
        self._lens_watched = False  # what WatchLens last said; a model loaded later follows

    def serve(self, receive: Callable[[], Request]) -> None:
        """Listen in a thread of its own, say Ready and run jobs here until Quit; the replies
        queued by then are sent before it returns."""
        listener = threading.Thread(
            target=self.listen, args=(receive,), name="engine-listen", daemon=True
        )
        listener.start()
        self.outbox.put(Ready())
        try:
            self.run()
        finally:
            stop_background(self.session, QUIT_JOIN_S)
            self.outbox.close()

    # -- listener thread ----------------------------------------------------------------------

    def listen(self, receive: Callable[[], Request]) -> None:
        while True:
            try:
                request = receive()
            except (EOFError, OSError):  # the client is gone
                request = Quit()
            match request:
                case Cancel(job=job):
                    self.cancel(job)
                case Pace():
                    self.pace(request)
                case Watch():
                    with self._lock:
                        session, job = self.session, self._reply_job
                    self.rows.watch(request, job, ring_of(session))
                case Cadence(interval_s=interval_s):
                    self.outbox.set_interval(interval_s)
                case Fetch():
                    with self._lock:
                        session, job = self.session, self._reply_job
                    self.rows.fetch(job, request, ring_of(session))
                case WatchLens(on=on):
                    self.watch_lens(on)
                case AskLens():
                    self.ask_lens(request)
                case Quit():
                    self.cancel(ALL_JOBS)
                    self.jobs.put(None)
                    return
                case Load() | Generate() | Reset() | Count():
                    self.jobs.put(request)

    def cancel(self, job: int) -> None:
        with self._lock:
            self._cancelled_upto = max(self._cancelled_upto, job)
            running = self._running_job and self._running_job <= job
            session = self.session if running else None
        if session is not None:
            session.cancel()
        self.outbox.wake()  # a reply waiting for room in the outbox goes on

    def pace(self, request: Pace) -> None:
        """Pause, step, resume or slow the session's replies (ignored before a model loads)."""
        with self._lock:
            session = self.session
        if session is None:
            return
        pacer = session.pacer
        if request.action == "play":
            pacer.play(request.rate)
        else:
            getattr(pacer, request.action)()

    def watch_lens(self, on: bool) -> None:
        """Keep (or stop keeping) each step's residuals for the logit lens."""
        with self._lock:
            self._lens_watched = on
            session = self.session
        watch = getattr(session, "watch_lens", None)  # a session without a lens ignores it
        if watch is not None:
            watch(on)

    def ask_lens(self, request: AskLens) -> None:
        """A step's logit lens, from the residuals the session kept: one batched pass through
        the head, computed in the engine's main thread (torch from this thread would start a
        second OpenMP pool: see engine.generate.pacing). While a reply runs, between two of its
        steps or at once while it is held; otherwise as the next job."""
        with self._lock:
            session = self.session
            pacer = getattr(session, "pacer", None)
            if self._running_job and pacer is not None:
                pacer.run_between_steps(lambda: self._answer_lens(session, request))
                return
        self.jobs.put(request)

    def _answer_lens(self, session: Any, request: AskLens) -> None:
        lens = None
        layer_lens = getattr(session, "layer_lens", None)
        if layer_lens is not None:
            try:
                lens = layer_lens(request.step, request.top)
            except Exception:
                log.exception("the logit lens of step %d failed", request.step)
        self.outbox.put(Lensed(request.job, lens))

    def cancelled(self, job: int) -> bool:
        return job <= self._cancelled_upto

    # -- main thread ---------------------------------------------------------------------------

    def run(self) -> None:
        while (job := self.jobs.get()) is not None:
            match job:
                case Load(job=ident, request=request):
                    self.load(ident, request)
                case Generate():
                    self.generate(job)
                case Reset():
                    self.reset()
                case Count(job=ident, messages=messages):
                    self.count(ident, messages)
                case AskLens():  # answered by its Lensed, not a Done
                    with self._lock:
                        session = self.session
                    self._answer_lens(session, job)
                    continue
            self.outbox.put(Done(job.job))

    def load(self, job: int, request: LoadRequest) -> None:
        def progress(stage: str, fraction: float) -> None:
            self.outbox.put(Progress(job, stage, fraction))

        try:
            with collector.paused():
                session = load_session(self._loader, self._session_factory, request, progress)
        except Exception as error:
            if explained(error):  # the user's to act on: the message says all
                log.warning("loading %r failed: %s", request.spec, error)
            else:
                log.exception("loading %r failed", request.spec)
            fits_as = proposed_request(request, error)
            self.outbox.put(LoadFailed(job, describe_error(error), fits_as))
            return
        with self._lock:
            unloaded, self.session = self.session, session
        stop_background(unloaded, 0)  # its recording under way ends by itself, none after
        if self._lens_watched:
            self.watch_lens(True)
        self.outbox.put(Loaded(job, session.info))
        self._report_decode_step(job, session)

    def _report_decode_step(self, job: int, session: Any) -> None:
        """Say when a fast model's compiled decode step is attached, or that it will not be."""
        if getattr(session, "info", None) is None or session.info.precision != "fast":
            return
        compiling = getattr(session, "compiling", None)
        if compiling is None:
            from engine.step.compiled import NOT_COMPILED  # torch: only a fast model has it

            self.outbox.put(DecodeStep(job, NOT_COMPILED))
            return

        def report() -> None:
            compiling.done.wait()
            self.outbox.put(DecodeStep(job, compiling.state))

        threading.Thread(target=report, name="decode-step-report", daemon=True).start()

    def generate(self, request: Generate) -> None:
        job = request.job
        with self._lock:
            self._running_job = self._reply_job = job
        self.rows.start_reply()
        pull = not request.probes.token_rows
        probes = request.probes
        if pull:  # the prompt's matrix leaves the device only for a layer a panel draws
            probes = replace(probes, prompt_layers=tuple(sorted(self.rows.layers)))
        push = self._sender(job, request.stream, pull)
        if self.session is not None:  # the window shows when the reply is really held
            self.session.pacer.on_hold = self._on_hold(job)
        self._set_threads("prefill")
        try:
            run_generation(
                self.session, request.messages, request.settings, probes,
                self._decode_after(push), lambda: self.cancelled(job),
            )  # fmt: skip
        finally:
            self._set_threads("decode")
            with self._lock:
                self._running_job = 0
            pacer = getattr(self.session, "pacer", None)
            if pacer is not None:  # a lens asked as the reply ended
                pacer.run_errands()

    def _decode_after(self, push: Callable[[list[Event]], None]) -> Callable[[list[Event]], None]:
        """`push`, which first sets the decode threads once the prompt is processed (the
        session pushes PrefillDone before it decodes a step)."""

        def push_then_decode(events: list[Event]) -> None:
            if any(isinstance(event, PrefillDone) for event in events):
                self._set_threads("decode")
            push(events)

        return push_then_decode

    def _set_threads(self, phase: str) -> None:
        torch = sys.modules.get("torch")
        if self.threads is not None and torch is not None:
            torch.set_num_threads(getattr(self.threads, phase))

    def _on_hold(self, job: int) -> Callable[[bool], None]:
        """The pacer's hold, sent after the held step's rows (a teacher sees the step)."""

        def held(on: bool) -> None:
            if on:
                ring = ring_of(self.session)
                self.rows.flush(ring)
                self.rows.send_owed()  # the model waits: the prompt's rows cross now
            self.outbox.put(Held(job, on))

        return held

    def _sender(self, job: int, stream: bool, pull: bool) -> Callable[[list[Event]], None]:
        """Events to the client as they come; without `stream`, only the reply's end. `pull`:
        the client pulls attention rows (ViewRows) rather than getting them with each token."""
        ring = ring_of(self.session)

        def push(events: list[Event]) -> None:
            if not stream:
                events = [e for e in events if isinstance(e, Failed | Finished)]
                if not events:
                    return
            if any(isinstance(e, Failed | Finished) for e in events):
                self.rows.flush(ring)  # the last step's rows before the reply's end
                self.rows.send_owed()  # and the prompt's rows that crossed pooled
            events = self.rows.outgoing(events, pull, ring, job)
            weight = sum(event_weight(event) for event in events)
            self.outbox.put(Events(job, tuple(events)), weight)
            self.rows.after(job, events, ring)
            self.outbox.wait_for_room(lambda: self.cancelled(job))

        return push

    def count(self, job: int, messages: Sequence[Message]) -> None:
        try:
            tokens = self.session.count_tokens(messages) if self.session is not None else None
        except Exception:
            log.exception("counting tokens failed")
            tokens = None
        self.outbox.put(Counted(job, tokens))

    def reset(self) -> None:
        try:
            if self.session is not None:
                self.session.reset()
        except Exception:
            log.exception("resetting the session failed")
