"""The engine in a process of its own: the window's transport to the engine server.

Python's interpreter lock is shared by the threads of a process: a model thread dispatching
hundreds of small torch ops per step waits for it whenever the GUI thread paints, and decodes
much slower. In a child process the model has an interpreter to itself.

One pipe each way carries the protocol's messages (app.server.wire), pickled (app.server.pipe:
replies carry their numpy arrays out of band, and those of a MB or more through shared memory, see
app.server.shared_arrays). The child runs the engine server (app.server.engine_server). This module
is what the window imports to start the child, so it imports nothing heavy: the child starts
importing torch before the window's process has imported even numpy.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import Connection
from pathlib import Path

from app.server.engine_spec import EngineSpec
from app.server.pipe import encode, receive_message
from app.server.shared_arrays import SharedFolder
from app.server.wire import ALL_JOBS, Cancel, Quit, Reply, Request

log = logging.getLogger(__name__)

ENGINE_NICENESS = 5  # how far below the window the engine runs (see give_way_to_the_window)


class EngineProcess:
    """A started engine child and the GUI's ends of its two pipes (an app.server.wire.Transport).
    Qt-free: the app starts it before it builds any window, so torch imports while the window
    is being built."""

    def __init__(self, spec: EngineSpec | None = None) -> None:
        import multiprocessing

        self.spec = spec or EngineSpec()
        context = multiprocessing.get_context("spawn")  # fork would copy Qt's threads and state
        child_requests, self.requests = context.Pipe(duplex=False)
        self.replies, child_replies = context.Pipe(duplex=False)
        self.shared = SharedFolder.create()
        # Removed once: by close, whichever side died, or at exit by an owner that never
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

    def send(self, message: Request) -> bool:
        """Write a request; False if the child is gone."""
        data = encode(message)
        with self._send_lock:
            try:
                self.requests.send_bytes(data)
            except (OSError, ValueError):
                return False
        return True

    def receive(self) -> tuple[Reply, int]:
        """The next reply and its size in bytes (blocking); EOFError once the child is gone."""
        try:
            reply: Reply
            reply, size = receive_message(self.replies)
            return reply, size
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

    def stop(self, timeout_s: float = 5.0, patient: bool = True) -> None:
        """Ask the child to quit, then make sure it has: nothing is left running. Importing or
        loading cannot be interrupted and loses nothing if cut: not `patient`, it waits 0.5 s."""
        self.send(Cancel(ALL_JOBS))
        self.send(Quit())
        timeout_s = timeout_s if patient else 0.5
        self.process.join(timeout_s)
        if self.process.is_alive():  # busy in a load that cannot be interrupted
            log.warning("the engine did not quit within %.0f s: terminating it", timeout_s)
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def again(self) -> EngineProcess:
        return EngineProcess(self.spec)

    def close(self) -> None:
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
    spin a while at a barrier before they sleep (300,000 pauses). Making them sleep sooner
    (10,000) let the window in no faster beside a lower-priority engine, while a thread put
    to sleep between two of a step's operations sometimes woke late on a virtual machine:
    some replies of that engine alone were far slower than the rest, and decoding beside the
    window was no faster and less even than with the default spin.
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
    # Imported here, in the child: the window's process never imports the engine's side.
    from app.server.engine_server import serve

    serve(requests, replies, spec, SharedFolder(shared) if shared is not None else None)


def _nothing() -> None:
    pass


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
