"""One model, one generation at a time: requests wait their turn in a bounded FIFO queue, each
generation runs on the engine's one thread, and its events come back to the server's loop.

    job = await queue.start(Ask(messages, settings, probes, agent), disconnected)
    async for event in job.events(): ...

A job holds the model from the moment its turn comes until its generator ends; a client that
goes away sets the session's cancel flag, so the generation ends after the current step and
the next job starts. `start` returns once the first event is in, so a prompt the engine
refuses (too long for the context) is answered with an error status before any reply begins.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from app.api.errors import ApiError
from engine.events import Event, Failed, Finished
from engine.settings import GenerationSettings, Message, ProbeSettings

log = logging.getLogger(__name__)

CONTEXT_FULL = "ContextFull"  # Failed.error_type of a prompt beyond the context


@dataclass(frozen=True)
class Ask:
    """One request's generation: its messages, how to sample and probe, and who asked (the
    request's User-Agent, for an engine that shows it)."""

    messages: tuple[Message, ...]
    settings: GenerationSettings
    probes: ProbeSettings
    client: str = ""


class Engine(Protocol):
    """What the server needs of the model: its name and context, a blocking generator of the
    engine's events (run on the queue's thread), and a cancel callable from any thread."""

    @property
    def model_id(self) -> str: ...

    @property
    def max_context(self) -> int: ...

    def generate(self, ask: Ask) -> Iterator[Event]: ...

    def cancel(self) -> None: ...


class EngineQueue:
    """The bounded FIFO in front of the engine: `limit` requests may wait behind the running
    one; one more is refused with 429 and a Retry-After."""

    def __init__(self, engine: Engine, limit: int, retry_after_s: int = 1) -> None:
        self.engine = engine
        self.limit = limit
        self.retry_after_s = retry_after_s
        self._turn = asyncio.Lock()  # FIFO: waiters are woken in the order they came
        self._admitted = 0  # waiting or running
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="api-engine")
        self.finished: list[Finished] = []  # the latest replies' endings, newest last (bounded)

    @property
    def waiting(self) -> int:
        return max(self._admitted - 1, 0)

    async def start(self, ask: Ask, disconnected: Callable[[], Awaitable[object]]) -> Job:
        """Wait for the model (or refuse: 429 when the queue is full), start the generation,
        and return once its first event is in (400 context_length_exceeded when the prompt
        does not fit). `disconnected()` returns when the client goes: a client gone while it
        waits leaves the queue; one gone while it is answered cancels its generation."""
        if self._admitted > self.limit:
            raise ApiError(
                429,
                f"The server is busy: {self.waiting} requests are already waiting for the model."
                " Try again shortly.",
                code="queue_full",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self._admitted += 1
        gone = asyncio.ensure_future(disconnected())
        try:
            await self._wait_turn(gone)
        except BaseException:
            self._admitted -= 1
            gone.cancel()
            raise
        job = Job(self, asyncio.get_running_loop(), gone)
        job.run(ask)
        try:
            await job.refuse_if_unfit()
        except BaseException:
            job.cancel()
            raise
        return job

    async def _wait_turn(self, gone: asyncio.Future[Any]) -> None:
        """Take the model when this request's turn comes, unless its client goes first."""
        turn: asyncio.Future[Any] = asyncio.ensure_future(self._turn.acquire())
        try:
            await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the request itself was cancelled
            self._give_up(turn)
            raise
        if gone.done():
            self._give_up(turn)
            raise ApiError(499, "The client closed the request while it waited.")

    def _give_up(self, turn: asyncio.Future[Any]) -> None:
        """Leave the queue: a turn not yet come is withdrawn, one that came is passed on."""
        if turn.done() and not turn.cancelled():
            self._turn.release()
        else:
            turn.cancel()

    def release(self) -> None:
        """The running job's generator has ended: the next in line gets the model."""
        self._admitted -= 1
        self._turn.release()

    def record(self, finished: Finished) -> None:
        self.finished = [*self.finished[-31:], finished]

    def close(self) -> None:
        self.engine.cancel()
        self._thread.shutdown(wait=True, cancel_futures=True)


class Job:
    """One generation on the engine's thread, its events handed to the server's loop."""

    def __init__(
        self, queue: EngineQueue, loop: asyncio.AbstractEventLoop, gone: asyncio.Future[Any]
    ) -> None:
        self._queue = queue
        self._loop = loop
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()  # None: generator ended
        self._first: Event | None = None
        self._cancelled = threading.Event()
        self._gone = gone
        self._watch: asyncio.Future[None] | None = None
        self._done = False  # the generator's end has been read
        self._ended = False  # the generator has ended and the model was passed on

    def run(self, ask: Ask) -> None:
        self._queue._thread.submit(self._generate, ask)
        self._watch = asyncio.ensure_future(self._cancel_on(self._gone))

    def _generate(self, ask: Ask) -> None:
        """The engine's thread: every event to the loop, then None, then the model is free."""
        put = self._deliver
        try:
            if self._cancelled.is_set():  # gone before its turn's first step
                return
            for event in self._queue.engine.generate(ask):
                self._loop.call_soon_threadsafe(put, event)
                if self._cancelled.is_set():  # a cancel that came before generate() began
                    self._queue.engine.cancel()
        except Exception as error:  # the server outlives anything the engine throws
            log.exception("generation failed")
            self._loop.call_soon_threadsafe(put, Failed(str(error), type(error).__name__))
        finally:
            self._loop.call_soon_threadsafe(put, None)
            self._loop.call_soon_threadsafe(self._end)

    def _deliver(self, event: Event | None) -> None:
        """The server's loop: an event to the reader; an ending is recorded, read or not."""
        if isinstance(event, Finished):
            self._queue.record(event)
        self._events.put_nowait(event)

    def _end(self) -> None:
        """The server's loop: this generation is over, the model goes to the next in line."""
        self._ended = True
        self._queue.release()

    async def _cancel_on(self, gone: asyncio.Future[Any]) -> None:
        await gone
        log.info("client went away: cancelling its generation")
        self.cancel()

    def cancel(self) -> None:
        """Stop after the current step (the session's cancel flag). On the server's loop,
        which also passes the model on (`_end`): a late cancel never reaches the next job."""
        self._cancelled.set()
        if not self._ended:
            self._queue.engine.cancel()

    async def refuse_if_unfit(self) -> None:
        """Wait for the first event; a prompt the engine found too long is a 400."""
        self._first = await self._events.get()
        if isinstance(self._first, Failed) and self._first.error_type == CONTEXT_FULL:
            message = self._first.message
            await self._drain()
            raise ApiError(400, message, param="messages", code="context_length_exceeded")

    async def events(self) -> AsyncIterator[Event]:
        """The generation's events, the first included; cancels it if the reader stops."""
        try:
            event = self._first
            while event is not None:
                yield event
                event = await self._events.get()
            self._done = True
        finally:
            if not self._done:
                self.cancel()
            self._stop_watching()

    async def _drain(self) -> None:
        while await self._events.get() is not None:
            pass
        self._done = True
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        self._gone.cancel()
