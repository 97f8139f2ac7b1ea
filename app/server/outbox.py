"""The engine server's outbox: replies written by a thread of their own, a reply's later
tokens gathered into fewer messages, and a generation held back while the window is behind."""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable

from app.server.os_threads import name_this_thread
from app.server.wire import Events, Reply
from engine.events import StepRows, Token

MAX_UNSENT_WEIGHT = 8 * 2**20  # a generation waits while this much is not yet written
# A reply's tokens go out at most this often (its first token, its end and everything else at
# once): the window draws at most 30 frames a second, and each message wakes its receiving
# thread, which then takes a core from the engine: a few tokens a message cost that thread
# less than one message per token.
TOKEN_INTERVAL_S = 0.033
# The longest a client may ask for (wire.Cadence): the window's slowest delivery (2 a second).
SLOWEST_TOKEN_INTERVAL_S = 0.5

SENDER_THREAD = "engine-send"  # the thread's name for the OS
Write = Callable[[Reply, int], object]  # (reply, weight): sends it; OSError once nobody reads


class Outbox:
    """Replies written by a thread of their own; the events waiting go out as one message.

    A reply's later tokens wait until `interval_s` has passed since the last message, so that
    tokens faster than the window draws cross a few at a time; anything else (a reply's first
    token, its end, a hold, any other reply) goes out at once and takes the waiting ones along,
    and so do tokens that weigh half of MAX_UNSENT_WEIGHT (long rows at a GPU's rate): the
    engine, which waits past that weight, is never held up by the wait.

    While a reply streams, the sending thread sleeps after a message until the next one is due,
    not until the next token: a later token that comes meanwhile wakes nobody, and the thread
    wakes once per message instead of twice (the token's wake-up only found the message not yet
    due). Each wake-up of that thread takes the interpreter lock or a core from the generation.
    """

    def __init__(self, write: Write, interval_s: float = TOKEN_INTERVAL_S) -> None:
        self._write = write
        self._interval_s = interval_s
        self._last_write = -math.inf
        # (reply, weight, queued at, whether it may wait for the next message)
        self._items: deque[tuple[Reply, int, float, bool]] = deque()
        self._weight = 0
        self._urgent = 0  # items queued that may not wait for the next message
        self._pacing = False  # the sending thread sleeps until the next message is due
        self._streaming = False  # the last message sent a reply's tokens, and not its end
        self.wakeups = 0  # the sending thread's wake-ups from a wait (tests read it)
        self._closed = False
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=SENDER_THREAD, daemon=True)
        self._thread.start()

    def put(self, reply: Reply, weight: int = 0) -> None:
        """Queue a reply. The sending thread is woken only where it acts on it at once: one
        that may not wait, the weight past what may wait, or a first item while the thread
        sleeps with no message due; a later token otherwise waits for the message already
        due, and waking the thread per token cost a GPU-rate reply a core's tenth."""
        with self._condition:
            idle = not self._items and not self._pacing
            urgent = not _later_tokens(reply)
            self._items.append((reply, weight, time.monotonic(), not urgent))
            self._weight += weight
            self._urgent += urgent
            if idle or urgent or self._weight >= MAX_UNSENT_WEIGHT // 2:
                self._condition.notify_all()

    def set_interval(self, interval_s: float) -> None:
        """Let a reply's later tokens wait up to `interval_s` (at most SLOWEST_TOKEN_INTERVAL_S)
        for the next message: the client takes them in no more often than that."""
        with self._condition:
            self._interval_s = min(max(interval_s, 0.0), SLOWEST_TOKEN_INTERVAL_S)
            self._condition.notify_all()

    @property
    def interval_s(self) -> float:
        return self._interval_s

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

    def _next(self) -> tuple[Reply, int] | None:
        with self._condition:
            while not self._due():
                left = self._last_write + self._interval_s - time.monotonic()
                # Until the next message is due where one will be (items wait, or a reply
                # streams), else until an item comes
                self._pacing = left > 0 and (bool(self._items) or self._streaming)
                self._condition.wait(left if self._pacing else None)
                self._pacing = False
                self.wakeups += 1
            if not self._items:
                return None
            reply, weight, queued_at = self._take()
            if isinstance(reply, Events):  # coalesce the events queued behind it
                events = list(reply.events)
                while self._items and _same_job_events(self._items[0][0], reply.job):
                    more, more_weight, _ = self._take()
                    assert isinstance(more, Events)  # checked by _same_job_events
                    events.extend(more.events)
                    weight += more_weight
                reply = Events(reply.job, tuple(events), queued_at)  # the oldest wait counts
            self._streaming = isinstance(reply, Events) and _goes_on(reply)
            self._weight -= weight
            self._condition.notify_all()
            return reply, weight

    def _take(self) -> tuple[Reply, int, float]:
        reply, weight, queued_at, may_wait = self._items.popleft()
        self._urgent -= not may_wait
        return reply, weight, queued_at

    def _due(self) -> bool:
        """Whether to stop waiting (the condition held): something to send now, or closed."""
        if not self._items:
            return self._closed
        return not self._may_wait() or time.monotonic() >= self._last_write + self._interval_s

    def _may_wait(self) -> bool:
        """Whether what is queued may wait for the next message (the condition held)."""
        light = self._weight < MAX_UNSENT_WEIGHT // 2
        return not self._closed and light and not self._urgent

    def _run(self) -> None:
        name_this_thread(SENDER_THREAD)  # what a benchmark reads its CPU time by
        while (item := self._next()) is not None:
            self._last_write = time.monotonic()
            try:
                self._write(*item)
            except (OSError, ValueError):  # the client is gone: nobody to tell
                with self._condition:
                    self._closed = True
                    self._items.clear()
                    self._urgent = 0
                    self._condition.notify_all()
                return


def _later_tokens(reply: Reply) -> bool:
    """Events that may wait for the next message: tokens of a reply after its first, and the
    latest rows a panel draws (a step's rows asked for go at once)."""
    return isinstance(reply, Events) and all(
        (isinstance(event, Token) and event.index > 0)
        or (isinstance(event, StepRows) and event.latest)
        for event in reply.events
    )


def _goes_on(reply: Events) -> bool:
    """Whether a reply's tokens follow these events (they end with a token or its rows)."""
    return bool(reply.events) and isinstance(reply.events[-1], Token | StepRows)


def _same_job_events(reply: Reply, job: int) -> bool:
    return isinstance(reply, Events) and reply.job == job
