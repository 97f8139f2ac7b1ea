"""The engine in a process of its own: how the window starts it, and the messages between them.

Python's interpreter lock is shared by the threads of a process: a model thread dispatching
hundreds of small torch ops per step waits for it whenever the GUI thread paints (measured
here: 35-45% of decode speed lost). In a child process the model has an interpreter to itself.

One channel each way, each a pipe of pickled tuples (`EngineProcess` makes them; replies carry
their numpy arrays out of band, see `send_message`, and those of a MB or more through shared
memory, see app.shared_arrays):

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

The child's side, its threads and jobs, is app.engine_server. This module is what the window
imports to start the child, so it imports nothing heavy: the child starts importing torch
before the window's process has imported even numpy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import struct
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from app.shared_arrays import MIN_SHARED_BYTES, SharedFolder, take

# A request or a reply on the pipes: its kind first, then fields of any picklable type.
Frame = tuple[Any, ...]

log = logging.getLogger(__name__)

PIPE_BYTES = 2**20  # a token's attention rows at 10,000 keys (1.4 MB) in one or two writes
PICKLE_PROTOCOL = 5  # numpy arrays can travel out of band, as their own frames
INLINE, SHARED = 0, 1  # where an array's bytes travel: in the pipe, or in shared memory
ENGINE_NICENESS = 5  # how far below the window the engine runs (see give_way_to_the_window)


@dataclass(frozen=True)
class EngineSpec:
    """What the child runs, as importable names ("module:attribute"), so that a test can run
    its own fake session in the child just as the app runs the real one."""

    loader: str = "app.jobs:default_loader"
    session_factory: str = "app.jobs:default_session_factory"
    preload: tuple[str, ...] = ("engine.loader", "engine.session")  # imported at start
    # torch's intra-op threads while decoding; None: every core on a machine of one or two,
    # all cores but one, left to the window, on larger ones. Beside the window on this 2-core
    # machine, two decoding threads reached 0.63-0.85x a terminal engine recording the same
    # probes (panels all floating, docked, closed), one thread 0.62-0.69x: leaving a core
    # costs half the compute there, while sharing one costs what the window's bursts hold an
    # OpenMP thread up at its barriers (~15-25%). With more cores, the core left costs less.
    threads: int | None = None
    # ... and while a prompt is processed; None: every core. The window has little to draw
    # until the first token, and prefill, all large matrix products, gains most from them.
    prefill_threads: int | None = None
    # Shares the machine with a window (see give_way_to_the_window). False: the terminal
    # chat's engine, as the window benchmark's reference runs it: every core throughout.
    beside_window: bool = True


def encode(message: Frame) -> bytes:
    return pickle.dumps(message, protocol=PICKLE_PROTOCOL)


def send_message(connection: Connection, message: Frame, shared: SharedFolder | None = None) -> int:
    """Write `message` as a pickle frame whose arrays follow as frames of their own, written
    straight from the arrays' memory, or, from MIN_SHARED_BYTES on, through `shared` memory
    (the frame then holds the file's path; see app.shared_arrays); returns the bytes sent."""
    buffers: list[pickle.PickleBuffer] = []
    header = pickle.dumps(message, protocol=PICKLE_PROTOCOL, buffer_callback=buffers.append)
    raws = [buffer.raw() for buffer in buffers]
    paths = [_share(raw, shared) for raw in raws]
    kinds = bytes(INLINE if path is None else SHARED for path in paths)
    connection.send_bytes(struct.pack("!I", len(raws)) + kinds + header)
    for raw, path in zip(raws, paths, strict=True):
        connection.send_bytes(raw if path is None else path.encode())
    return 4 + len(kinds) + len(header) + sum(raw.nbytes for raw in raws)


def _share(raw: memoryview, shared: SharedFolder | None) -> str | None:
    if shared is None or raw.nbytes < MIN_SHARED_BYTES:
        return None
    return shared.write(raw)


def receive_message(connection: Connection) -> tuple[Frame, int]:
    """Read what `send_message` wrote: (message, bytes). Arrays come back read-only, over
    buffers read from the pipe with the interpreter lock released (no copy under it on POSIX:
    a token's rows at 10,000 keys are 1.4 MB, and the window's thread must not wait for
    them) or mapped from shared memory."""
    first = _read_frame(connection)
    (count,) = struct.unpack_from("!I", first)
    kinds = first[4 : 4 + count]
    buffers = [_buffer(kind, _read_frame(connection)) for kind in kinds]
    size = len(first) + sum(b.nbytes for b in buffers)
    return pickle.loads(memoryview(first)[4 + count :], buffers=buffers), size


def _buffer(kind: int, frame: bytes | bytearray) -> memoryview:
    if kind == SHARED:
        return take(frame.decode())
    return memoryview(frame).toreadonly()


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
        self.shared = SharedFolder.create()
        # Removed once: by close_pipes, whichever side died, or at exit by an owner that never
        # closed them.
        remove = self.shared.remove if self.shared is not None else _nothing
        self._remove_shared = weakref.finalize(self, remove)
        self.process = context.Process(
            target=_run_child,
            args=(child_requests, child_replies, self.spec, self.shared and self.shared.path),
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
        self._remove_shared()  # the arrays still in it were never read

    def kill(self) -> None:
        """SIGKILL the child (tests and benchmarks use it to check recovery)."""
        pid = self.process.pid
        assert pid is not None  # started when it was made
        os.kill(pid, signal.SIGKILL)


def give_way_to_the_window() -> None:
    """Let the window's threads have a core as soon as they want one; before torch loads.

    The engine runs one step down in priority, so the window's short bursts preempt it
    instead of waiting for its time slice. OpenMP's waiting is left as it is: its threads
    spin ~20 ms at a barrier before they sleep (300,000 pauses). Making them sleep sooner
    (10,000) let the window in no faster beside a lower-priority engine (stall p99 9.4-13.9
    ms against 9.6-11.9), while a thread put to sleep between two of a step's operations
    sometimes woke late on this virtual machine: replies of that engine alone fell to 13-29
    tokens/s among ones at 37, and the window decoded at 0.53-0.83x the terminal chat
    (median 0.74) against 0.75-0.81x (median 0.76) with the default spin, in five
    interleaved bench --window runs each way.
    """
    if hasattr(os, "nice"):  # not on Windows
        with contextlib.suppress(OSError):
            os.nice(ENGINE_NICENESS)


def _run_child(
    requests: Connection, replies: Connection, spec: EngineSpec, shared: Path | None
) -> None:
    """The child's entry: only the child imports the engine's side (and torch through it)."""
    if spec.beside_window:
        give_way_to_the_window()
    from app.engine_server import serve

    serve(requests, replies, spec, SharedFolder(shared) if shared is not None else None)


def _nothing() -> None:
    pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
