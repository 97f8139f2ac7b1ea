"""The window's engine behind the API: each request is answered as a reply of the window.

    engine = WindowEngine(bridge)          # app.api's Engine, used on the API's engine thread
    bridge = ApiBridge(window, worker, open_conversation)   # lives in the GUI thread

The API's thread never touches Qt objects. `WindowEngine.generate` hands its request to the
GUI thread as a queued signal and then reads the reply's events from a thread-safe queue of
its own. In the GUI thread, `ApiBridge` starts the request once the window's engine is free
(a message typed in the window, or an earlier request, finishes first): it opens a
conversation of its own in the sidebar and starts the reply through the window, as a typed
message does, so the chat and every panel show it. The engine client's event delivery feeds
the request's queue, up to the reply's Finished. The GUI thread never waits for the API.

A client that goes away cancels through the engine client's Stop (within one decode step); a
request still waiting for its turn is dropped before it starts. Stepping holds the reply in
the engine, and the client simply waits for its next token.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from PySide6.QtCore import QObject, Signal, Slot

from app.api.engine_queue import Ask
from app.client.engine_client import EngineClient
from engine.events import Event, Failed, Finished, ModelInfo
from ui.conversation import ReplyState
from ui.main_window import MainWindow

log = logging.getLogger(__name__)

STOPPED = "The window stopped serving."


@dataclass(eq=False)
class ApiRequest:
    """One request on its way through the window; `events` ends with None."""

    ask: Ask
    events: queue.SimpleQueue[Event | None] = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def end(self, failure: str | None = None) -> None:
        """End the request's events (with a failure the client is told, if any)."""
        if failure is not None:
            self.events.put(Failed(failure, "EngineUnavailable"))
        self.events.put(None)


class WindowEngine:
    """app.api.engine_queue.Engine over the window's engine; its methods are called on the
    API's threads. `info` reads the loaded model (None before one has loaded)."""

    def __init__(self, submit: Callable[[ApiRequest], None], cancel: Callable[[], None]) -> None:
        self._submit = submit
        self._cancel = cancel
        self._info: ModelInfo | None = None
        self._lock = threading.Lock()
        self._live: set[ApiRequest] = set()
        self._closed = False

    def set_info(self, info: ModelInfo | None) -> None:
        """The model the window has loaded (GUI thread, on every load)."""
        self._info = info

    @property
    def model_id(self) -> str:
        return self._info.name if self._info is not None else ""

    @property
    def max_context(self) -> int:
        return self._info.max_context if self._info is not None else 0

    def generate(self, ask: Ask) -> Iterator[Event]:
        request = ApiRequest(ask)
        with self._lock:
            if self._closed:
                request.end(STOPPED)
            else:
                self._live.add(request)
                self._submit(request)
        try:
            while (event := request.events.get()) is not None:
                yield event
        finally:
            with self._lock:
                self._live.discard(request)

    def cancel(self) -> None:
        """The running request's client went away (or the server stops)."""
        with self._lock:
            if self._closed:  # the requests ended at close; the GUI side may be gone
                return
            for request in self._live:
                request.cancelled.set()
        self._cancel()

    def close(self) -> None:
        """No more requests; those under way end now (their generation is stopped apart)."""
        with self._lock:
            self._closed = True
            live, self._live = self._live, set()
        for request in live:
            request.cancelled.set()
            request.end(STOPPED)


class ApiBridge(QObject):
    """The GUI side: API requests become replies of the window, one at a time.

    `open_conversation(request)` opens a new conversation holding the request's messages
    (app.window.controller.ConversationController.open_api)."""

    _submitted = Signal(object)  # from the API's thread: an ApiRequest
    _cancelled = Signal()  # from the API's thread

    def __init__(
        self,
        window: MainWindow,
        worker: EngineClient,
        open_conversation: Callable[[ApiRequest], None],
    ) -> None:
        super().__init__(window)
        self.window, self.worker = window, worker
        self._open_conversation = open_conversation
        self._pending: deque[ApiRequest] = deque()
        self._active: ApiRequest | None = None
        self.engine = WindowEngine(self._submitted.emit, self._cancelled.emit)
        self.engine.set_info(worker.info)
        self._submitted.connect(self._on_submitted)
        self._cancelled.connect(self._on_cancelled)
        worker.events.connect(self._on_events)
        worker.busy_changed.connect(self._on_busy_changed)
        window.model_changed.connect(self.engine.set_info)

    @property
    def active(self) -> ApiRequest | None:
        """The request whose reply is streaming, if any."""
        return self._active

    @property
    def waiting(self) -> list[ApiRequest]:
        """The requests waiting for the window's engine, first in line first."""
        return list(self._pending)

    def close(self) -> None:
        """Stop answering: a reply under way is stopped, every request ends."""
        self.engine.close()
        if self._active is not None and self.window.replying:
            self.worker.stop()
        self._pending.clear()
        self._active = None
        for signal, slot in (
            (self.worker.events, self._on_events),
            (self.worker.busy_changed, self._on_busy_changed),
            (self.window.model_changed, self.engine.set_info),
        ):
            signal.disconnect(slot)

    # -- GUI thread ------------------------------------------------------------------------

    @Slot(object)
    def _on_submitted(self, request: ApiRequest) -> None:
        self._pending.append(request)
        self._start_next()

    @Slot()
    def _on_cancelled(self) -> None:
        active = self._active
        if active is not None and active.cancelled.is_set():
            log.info("the API client went away: stopping its reply")
            self.worker.stop()
        self._start_next()  # a request cancelled while it waited ends there

    def _on_busy_changed(self, busy: bool) -> None:
        if not busy:
            self._start_next()

    def _free(self) -> bool:
        window = self.window
        waiting = window.conversation_model.state is ReplyState.WAITING
        return not (self.worker.busy or window.replying or waiting or self._active)

    def _start_next(self) -> None:
        while self._pending and (self._pending[0].cancelled.is_set() or self._free()):
            request = self._pending.popleft()
            if request.cancelled.is_set():
                request.end()
            elif self.worker.info is None:
                request.end("No model is loaded in the window.")
            else:
                self._start(request)

    def _start(self, request: ApiRequest) -> None:
        self._open_conversation(request)
        probes = self.window.probe_settings()  # what the panels watch, and what the API asks
        probes = replace(probes, top_k=max(probes.top_k, request.ask.probes.top_k))
        # A teacher stepping through replies steps through this one too; its client waits.
        pause = self.window.settings_panel.pause_after_prefill()
        settings = replace(request.ask.settings, pause_after_prefill=pause)
        if self.window.answer(settings, probes):
            self._active = request
        else:
            request.end("The window's engine could not start the reply.")

    def _on_events(self, batch: list[Event]) -> None:
        request = self._active
        if request is None:
            return
        for event in batch:
            request.events.put(event)
            if isinstance(event, Finished):
                request.end()
                self._active = None
                return
