"""Recording the static step's buckets in the background, ahead of the context.

Recording a bucket's CUDA graph (compiling its kernels first) takes seconds to tens of seconds;
done when the context first reaches the bucket, it froze a reply for that long. Here the
buckets are recorded one at a time in a thread of their own, smallest first, from the moment
the model loads and then ahead of the context (engine/step/static.py decides which), while a
reply whose bucket is not ready yet runs that step uncaptured: correct, slower, never waiting.

One recording at a time bounds the background work (each holds a compile's memory); the
thread ends when nothing is queued, and `close` drops the queued ones and joins it, at unload
and at quit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

Step = TypeVar("Step")


class BucketRecorder(Generic[Step]):
    """`record(capacity)` run for each requested bucket, in a background thread, smallest first
    (urgent ones before the rest); `ready(capacity)` is its result once done (None before, or
    if the recording failed)."""

    def __init__(self, record: Callable[[int], Step], name: str = "bucket-recorder") -> None:
        self._record, self._name = record, name
        self._lock = threading.Condition()
        self._queued: set[int] = set()
        self._urgent: set[int] = set()  # queued buckets a reply is in already: recorded first
        self._in_flight: int | None = None
        self._ready: dict[int, Step] = {}
        self._failed: dict[int, str] = {}
        self._closed = False
        self._thread: threading.Thread | None = None

    def request(self, capacities: Iterable[int], urgent: bool = False) -> None:
        """Queue the buckets not recorded, queued or recording yet (nothing after close);
        `urgent` ones (a reply already in them) go before the rest."""
        with self._lock:
            wanted = set(capacities)
            if urgent and not self._closed:
                self._urgent |= wanted & self._queued
            known = self._queued | self._ready.keys() | self._failed.keys()
            new = wanted - known - {self._in_flight or 0}
            if self._closed or not new:
                return
            self._queued |= new
            if urgent:
                self._urgent |= new
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._lock.notify_all()

    def ready(self, capacity: int) -> Step | None:
        with self._lock:
            return self._ready.get(capacity)

    def recording(self, capacity: int) -> bool:
        """Whether `capacity`'s recording is running now (not queued: running)."""
        with self._lock:
            return self._in_flight == capacity

    def idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or recording; whether that came within `timeout`."""
        with self._lock:
            return self._lock.wait_for(
                lambda: self._in_flight is None and not self._queued, timeout
            )

    @property
    def buckets(self) -> list[int]:
        """The buckets recorded so far, smallest first."""
        with self._lock:
            return sorted(self._ready)

    @property
    def failed(self) -> dict[int, str]:
        with self._lock:
            return dict(self._failed)

    def close(self, timeout: float | None = None) -> bool:
        """Drop the queued buckets and join the thread (a recording under way finishes first:
        a compile cannot be interrupted); whether it ended within `timeout`."""
        with self._lock:
            self._closed = True
            self._queued.clear()
            self._urgent.clear()
            self._lock.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout)
        if thread.is_alive():
            log.warning("a decode step recording is still running at close")
        return not thread.is_alive()

    def _run(self) -> None:
        while (capacity := self._next()) is not None:
            began = time.perf_counter()
            try:
                step = self._record(capacity)
            except Exception as error:  # the bucket's steps stay uncaptured; say why
                self._finish(capacity, None, f"{type(error).__name__}: {error}", began)
                continue
            self._finish(capacity, step, None, began)

    def _next(self) -> int | None:
        """The smallest urgent bucket, else the smallest queued, marked in flight; None when
        there is none (the thread then ends, and a later request starts another)."""
        with self._lock:
            if self._closed or not self._queued:
                self._thread = None
                return None
            capacity = min(self._urgent or self._queued)
            self._queued.discard(capacity)
            self._urgent.discard(capacity)
            self._in_flight = capacity
            return capacity

    def _finish(self, capacity: int, step: Step | None, error: str | None, began: float) -> None:
        """Keep the result and log it (before any waiter wakes)."""
        with self._lock:
            if step is not None:
                self._ready[capacity] = step
                ready = ", ".join(map(str, sorted(self._ready)))
                seconds = time.perf_counter() - began
                log.info("decode step: bucket %d recorded in %.1f s; ready: %s",
                         capacity, seconds, ready)  # fmt: skip
            if error is not None:
                self._failed[capacity] = error
                log.warning("recording bucket %d failed: %s", capacity, error)
            self._in_flight = None
            self._lock.notify_all()
