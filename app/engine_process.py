"""The engine in a process of its own: the child side of the window's engine.

Python's interpreter lock is shared by the threads of a process: a model thread dispatching
hundreds of small torch ops per step waits for it whenever the GUI thread paints (measured
here: 35-45% of decode speed lost). In a child process the model has an interpreter to itself.

One channel each way, each a pipe of pickled tuples (`EngineProcess` makes them; replies carry
their numpy arrays out of band, see `send_message`):

  requests, GUI -> engine            replies, engine -> GUI
  ("load", LoadRequest)              ("ready",)                   torch & co. imported
  ("generate", job, messages,        ("progress", stage, fraction) throttled
      settings, probes, deliver)     ("loaded", ModelInfo) / ("load_failed", message)
  ("cancel", job)                    ("events", queued_at, [Event, ...])  engine events, unchanged
  ("reset",)                         ("done", kind)                a load or generate job ended
  ("count", ident, messages)         ("count", ident, tokens or None)
                                     ("decode_step", state)        after "loaded", once the
                                         compiled decode step is attached ("compiled") or not
  ("quit",)

Three threads in the child: the main one runs jobs in order; a listener reads requests and acts
on "cancel" at once, so Stop reaches the session within one decode step and is
never queued behind the reply it stops (a count is answered in order: the tokenizer is not
shared between threads); a sender pickles and writes replies, so a reply never
waits on the GUI's reader, and coalesces the events waiting into one message. Each event
crosses once: an attention row is sent with its token, never again.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import queue
import signal
import struct
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from app.jobs import describe_error, event_weight, load_session, run_generation
from engine.events import Event, Failed, Finished

if TYPE_CHECKING:
    from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

# A request or a reply on the pipes: its kind first, then fields of any picklable type.
Frame = tuple[Any, ...]

log = logging.getLogger(__name__)

MAX_UNSENT_WEIGHT = 8 * 2**20  # a generation waits while this much is not yet written
PIPE_BYTES = 2**20  # a token's attention rows at 10,000 keys (1.4 MB) in one or two writes
PICKLE_PROTOCOL = 5  # numpy arrays can travel out of band, as their own frames


@dataclass(frozen=True)
class EngineSpec:
    """What the child runs, as importable names ("module:attribute"), so that a test can run
    its own fake session in the child just as the app runs the real one."""

    loader: str = "app.jobs:default_loader"
    session_factory: str = "app.jobs:default_session_factory"
    preload: tuple[str, ...] = ("engine.loader", "engine.session")  # imported at start
    # torch's intra-op threads; None: one per core but one, left to the window. A window
    # drawing on a core that an OpenMP thread also wants stalls every op at its barrier: on
    # this 2-core machine two threads decoded at 0.2x the headless speed beside a busy window.
    threads: int | None = None


def engine_threads(spec: EngineSpec) -> int:
    """The spec's threads, else $GLASSBOX_ENGINE_THREADS, else all cores but one."""
    chosen = spec.threads or int(os.environ.get("GLASSBOX_ENGINE_THREADS", "0") or 0)
    return chosen if chosen > 0 else max(1, (os.cpu_count() or 2) - 1)


def resolve(name: str) -> Callable[..., Any]:
    module, _, attribute = name.partition(":")
    found: Callable[..., Any] = getattr(importlib.import_module(module), attribute)
    return found


def encode(message: Frame) -> bytes:
    return pickle.dumps(message, protocol=PICKLE_PROTOCOL)


def send_message(connection: Connection, message: Frame) -> int:
    """Write `message` as a pickle frame whose arrays follow as frames of their own, written
    straight from the arrays' memory; returns the bytes written."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(message, protocol=PICKLE_PROTOCOL, buffer_callback=buffers.append)
    connection.send_bytes(struct.pack("!I", len(buffers)) + header)
    size = 4 + len(header)
    for buffer in buffers:
        raw = buffer.raw()
        connection.send_bytes(raw)
        size += raw.nbytes
    return size


def receive_message(connection: Connection) -> tuple[Frame, int]:
    """Read what `send_message` wrote: (message, bytes). Arrays come back read-only, over
    buffers read from the pipe with the interpreter lock released (no copy under it on POSIX:
    a long prompt's attention is tens of MB, and the window's thread must not wait for it)."""
    header = _read_frame(connection)
    (count,) = struct.unpack_from("!I", header)
    buffers = [memoryview(_read_frame(connection)).toreadonly() for _ in range(count)]
    size = len(header) + sum(b.nbytes for b in buffers)
    return pickle.loads(memoryview(header)[4:], buffers=buffers), size


def _read_frame(connection: Connection) -> bytes | bytearray:
    """One frame of Connection.send_bytes; EOFError once the writer is gone."""
    if not hasattr(os, "readv"):  # Windows: a pipe handle, not a file descriptor
        return connection.recv_bytes()
    fd = connection.fileno()
    (size,) = struct.unpack("!i", _read_exact(fd, 4))
    if size == -1:  # over 2 GiB
        (size,) = struct.unpack("!Q", _read_exact(fd, 8))
    return _read_exact(fd, size)


def _read_exact(fd: int, size: int) -> bytearray:
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        read = os.readv(fd, [view[done:]])  # releases the interpreter lock while it reads
        if read == 0:
            raise EOFError("the engine's pipe was closed")
        done += read
    return data


def widen_pipe(connection: Connection) -> None:
    """Let one write carry a long token at once (Linux); elsewhere the default stays."""
    try:
        import fcntl
    except ImportError:  # Windows
        return
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(connection.fileno(), set_size, PIPE_BYTES)


# -- the child ------------------------------------------------------------------------------


def serve(requests: Connection, replies: Connection, spec: EngineSpec) -> None:
    """The child's main function: import, then run requests until "quit" or the GUI is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C in a terminal is the window's to handle
    logging.basicConfig(level=logging.WARNING, format="engine %(levelname)s %(name)s: %(message)s")
    widen_pipe(replies)
    engine = _Engine(replies, spec)
    listener = threading.Thread(target=engine.listen, args=(requests,), name="engine-listen")
    listener.daemon = True
    listener.start()
    for name in spec.preload:
        importlib.import_module(name)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(engine_threads(spec))
    engine.outbox.put(("ready",))
    try:
        engine.run()
    finally:
        engine.outbox.close()
        replies.close()


class _Outbox:
    """Replies written by a thread of their own; the events waiting go out as one message."""

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
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
                send_message(self._connection, message)
            except (OSError, ValueError):  # the GUI is gone: nobody to tell
                with self._condition:
                    self._closed = True
                    self._items.clear()
                    self._condition.notify_all()
                return


class _Engine:
    def __init__(self, replies: Connection, spec: EngineSpec) -> None:
        self.spec = spec
        self.outbox = _Outbox(replies)
        self.jobs: queue.Queue[Frame | None] = queue.Queue()
        self.session: Any = None
        self._lock = threading.Lock()
        self._cancelled_upto = 0
        self._running_job = 0

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
        try:
            run_generation(
                self.session,
                messages,
                settings,
                probes,
                self._sender(job) if deliver else self._final_only,
                lambda: self.cancelled(job),
            )
        finally:
            with self._lock:
                self._running_job = 0

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


# -- the parent's handle ------------------------------------------------------------------------


class EngineProcess:
    """A started engine child and the GUI's ends of its two pipes. Qt-free: the app starts it
    before it builds any window, so torch imports while the window is being built."""

    def __init__(self, spec: EngineSpec | None = None) -> None:
        import multiprocessing

        self.spec = spec or EngineSpec()
        context = multiprocessing.get_context("spawn")  # fork would copy Qt's threads and state
        child_requests, self.requests = context.Pipe(duplex=False)
        self.replies, child_replies = context.Pipe(duplex=False)
        self.process = context.Process(
            target=serve,
            args=(child_requests, child_replies, self.spec),
            name="glassbox-engine",
            daemon=True,
        )
        self.started_at = time.perf_counter()
        self.process.start()
        # Only the child holds these now: when it dies, reading `replies` ends at once.
        child_requests.close()
        child_replies.close()
        self._send_lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def send(self, message: Frame) -> bool:
        """Write a request; False if the child is gone."""
        data = encode(message)
        with self._send_lock:
            try:
                self.requests.send_bytes(data)
            except (OSError, ValueError):
                return False
        return True

    def receive(self) -> tuple[Frame, int]:
        """The next reply and its size in bytes (blocking); EOFError once the child is gone."""
        try:
            return receive_message(self.replies)
        except OSError as error:
            raise EOFError(str(error)) from error

    def why_stopped(self) -> str:
        """One line on how the child ended, for the user."""
        self.process.join(1.0)
        code = self.process.exitcode
        if code is None:
            return "The engine stopped responding"
        if code < 0:
            name = _signal_name(-code)
            if -code == getattr(signal, "SIGKILL", 9):
                return f"The engine was killed ({name}; out of memory?)"
            return f"The engine crashed ({name})"
        return f"The engine exited unexpectedly (exit code {code})"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the child to quit, then make sure it has: nothing is left running."""
        self.send(("cancel", sys.maxsize))
        self.send(("quit",))
        self.process.join(timeout_s)
        if self.process.is_alive():  # busy in a load that cannot be interrupted
            log.warning("the engine did not quit within %.0f s: terminating it", timeout_s)
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close_pipes(self) -> None:
        """Once nobody reads or writes them any more (after `stop` and the reader's end)."""
        for connection in (self.requests, self.replies):
            connection.close()

    def kill(self) -> None:
        """SIGKILL the child (tests and benchmarks use it to check recovery)."""
        pid = self.process.pid
        assert pid is not None  # started when it was made
        os.kill(pid, signal.SIGKILL)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
