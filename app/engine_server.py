"""The engine child's side of app.engine_process: it imports torch and the model's code, then
runs the GUI's requests until "quit" or the GUI is gone.

Three threads in the child: the main one runs jobs in order; a listener reads requests and acts
on "cancel" at once, so Stop reaches the session within one decode step and is
never queued behind the reply it stops (a count is answered in order: the tokenizer is not
shared between threads); a sender pickles and writes replies, so a reply never
waits on the GUI's reader, and coalesces the events waiting into one message. Each event
crosses once: an attention row is sent with its token, never again.
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
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from app import collector
from app.engine_process import EngineSpec, Frame, send_message, widen_pipe
from app.jobs import describe_error, event_weight, load_session, run_generation
from app.shared_arrays import SharedFolder
from engine.events import Event, Failed, Finished, PrefillDone

if TYPE_CHECKING:
    from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

log = logging.getLogger(__name__)

MAX_UNSENT_WEIGHT = 8 * 2**20  # a generation waits while this much is not yet written


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
    """The child's main function: import, then run requests until "quit" or the GUI is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in a terminal is the window's to handle
    logging.basicConfig(level=logging.WARNING, format="engine %(levelname)s %(name)s: %(message)s")
    widen_pipe(replies)
    engine = _Engine(replies, spec, shared)
    listener = threading.Thread(target=engine.listen, args=(requests,), name="engine-listen")
    listener.daemon = True
    listener.start()
    with collector.paused():
        for name in spec.preload:
            importlib.import_module(name)
        gc.freeze()  # what the imports made lives as long as the process: see app.collector
    torch = sys.modules.get("torch")
    if torch is not None:
        engine.threads = Threads.of(spec, torch.get_num_threads(), os.cpu_count() or 1)
        torch.set_num_threads(engine.threads.decode)  # a compiled decode step is built for it
    engine.outbox.put(("ready",))
    try:
        engine.run()
    finally:
        engine.outbox.close()
        replies.close()


class _Outbox:
    """Replies written by a thread of their own; the events waiting go out as one message."""

    def __init__(self, connection: Connection, shared: SharedFolder | None = None) -> None:
        self._connection = connection
        self._shared = shared
        self._items: deque[tuple[Frame, int, float]] = deque()  # (message, weight, queued at)
        self._weight = 0
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="engine-send", daemon=True)
        self._thread.start()

    def put(self, message: Frame, weight: int = 0) -> None:
        with self._condition:
            self._items.append((message, weight, time.monotonic()))
            self._weight += weight
            self._condition.notify_all()

    def wait_for_room(self, stop: Callable[[], bool]) -> None:
        """Block while more than MAX_UNSENT_WEIGHT waits to be sent (the GUI is behind), unless
        `stop()` says the reply was cancelled. The message being written does not count, so
        one large event (a long prompt's attention) does not hold decoding up as it crosses."""
        with self._condition:
            while self._weight > MAX_UNSENT_WEIGHT and not self._closed and not stop():
                self._condition.wait(0.05)

    def wake(self) -> None:
        with self._condition:
            self._condition.notify_all()

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._thread.join()

    def _next(self) -> Frame | None:
        with self._condition:
            while not self._items and not self._closed:
                self._condition.wait()
            if not self._items:
                return None
            message, weight, queued_at = self._items.popleft()
            if message[0] == "events":  # coalesce the events queued behind it
                events = list(message[2])
                while self._items and self._items[0][0][0] == "events":
                    more, more_weight, _ = self._items.popleft()
                    events.extend(more[2])
                    weight += more_weight
                message = ("events", queued_at, events)  # the oldest event's wait counts
            self._weight -= weight
            self._condition.notify_all()
            return message

    def _run(self) -> None:
        while (message := self._next()) is not None:
            try:
                send_message(self._connection, message, self._shared)
            except (OSError, ValueError):  # the GUI is gone: nobody to tell
                with self._condition:
                    self._closed = True
                    self._items.clear()
                    self._condition.notify_all()
                return


class _Engine:
    def __init__(
        self, replies: Connection, spec: EngineSpec, shared: SharedFolder | None = None
    ) -> None:
        self.spec = spec
        self.outbox = _Outbox(replies, shared)
        self.jobs: queue.Queue[Frame | None] = queue.Queue()
        self.session: Any = None
        self._lock = threading.Lock()
        self._cancelled_upto = 0
        self._running_job = 0
        self.threads: Threads | None = None  # once torch is imported; None without it

    # -- listener thread ----------------------------------------------------------------------

    def listen(self, requests: Connection) -> None:
        while True:
            try:
                message = pickle.loads(requests.recv_bytes())
            except (EOFError, OSError):  # the GUI process is gone
                message = ("quit",)
            kind = message[0]
            if kind == "cancel":
                self.cancel(message[1])
            elif kind == "quit":
                self.cancel(sys.maxsize)
                self.jobs.put(None)
                return
            else:
                self.jobs.put(message)

    def cancel(self, job: int) -> None:
        with self._lock:
            self._cancelled_upto = max(self._cancelled_upto, job)
            running = self._running_job and self._running_job <= job
            session = self.session if running else None
        if session is not None:
            session.cancel()
        self.outbox.wake()  # a reply waiting for room in the outbox goes on

    def count(self, ident: int, messages: Sequence[Message]) -> None:
        try:
            tokens = self.session.count_tokens(messages) if self.session is not None else None
        except Exception:
            log.exception("counting tokens failed")
            tokens = None
        self.outbox.put(("count", ident, tokens))

    def cancelled(self, job: int) -> bool:
        return job <= self._cancelled_upto

    # -- main thread ---------------------------------------------------------------------------

    def run(self) -> None:
        while (message := self.jobs.get()) is not None:
            kind, *args = message
            if kind == "load":
                self.load(*args)
                self.outbox.put(("done", "load"))
            elif kind == "generate":
                self.generate(*args)
                self.outbox.put(("done", "generate"))
            elif kind == "reset":
                self.reset()
            elif kind == "count":
                self.count(*args)

    def load(self, request: LoadRequest) -> None:
        def progress(stage: str, fraction: float) -> None:
            self.outbox.put(("progress", stage, fraction))

        try:
            with collector.paused():
                session = load_session(
                    resolve(self.spec.loader), resolve(self.spec.session_factory), request, progress
                )
        except Exception as error:
            log.exception("loading %r failed", request.spec)
            self.outbox.put(("load_failed", describe_error(error)))
            return
        with self._lock:
            self.session = session
        self.outbox.put(("loaded", session.info))
        self._report_decode_step(session)

    def _report_decode_step(self, session: Any) -> None:
        """Say when a fast model's compiled decode step is attached, or that it will not be."""
        if getattr(session, "info", None) is None or session.info.precision != "fast":
            return
        compiling = getattr(session, "compiling", None)
        if compiling is None:
            from engine.compiled_decode import NOT_COMPILED

            self.outbox.put(("decode_step", NOT_COMPILED))
            return

        def report() -> None:
            compiling.done.wait()
            self.outbox.put(("decode_step", compiling.state))

        threading.Thread(target=report, name="decode-step-report", daemon=True).start()

    def generate(
        self,
        job: int,
        messages: Sequence[Message],
        settings: GenerationSettings,
        probes: ProbeSettings,
        deliver: bool = True,
    ) -> None:
        with self._lock:
            self._running_job = job
        push = self._sender(job) if deliver else self._final_only
        self._set_threads("prefill")
        try:
            run_generation(
                self.session, messages, settings, probes, self._decode_after(push),
                lambda: self.cancelled(job),
            )  # fmt: skip
        finally:
            self._set_threads("decode")
            with self._lock:
                self._running_job = 0

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

    def _sender(self, job: int) -> Callable[[list[Event]], None]:
        def push(events: list[Event]) -> None:
            weight = sum(event_weight(event) for event in events)
            self.outbox.put(("events", 0.0, events), weight)
            self.outbox.wait_for_room(lambda: self.cancelled(job))

        return push

    def _final_only(self, events: list[Event]) -> None:
        """A headless reply (benchmarks): only its ending crosses to the GUI."""
        kept = [e for e in events if isinstance(e, Failed | Finished)]
        if kept:
            self.outbox.put(("events", 0.0, kept))

    def reset(self) -> None:
        try:
            if self.session is not None:
                self.session.reset()
        except Exception:
            log.exception("resetting the session failed")
