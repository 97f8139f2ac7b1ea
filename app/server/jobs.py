"""One load or one generation run as a job: the rules the engine server (app.server.engine_server)
runs them by. Qt-free, so the engine process never imports Qt.

A job reports through callbacks: `push(events)` for a generation's events, in order, and a
throttled `progress(stage, fraction)` for a load. Whatever happens, a generation job pushes
exactly one Finished last (with Failed before it on error), as the event contract says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from engine.events import (
    Event,
    Failed,
    Finished,
    FinishReason,
    ModelInfo,
    PrefillDone,
    Tally,
    Token,
)
from engine.generate.pacing import Pacer
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.03  # loaders may report per tensor; the progress bar needs far less
EVENT_WEIGHT = 1024  # an event's weight in bytes, besides its attention arrays


class Session(Protocol):
    """What a job needs of a chat session (engine.generate.session.ChatSession has it)."""

    @property
    def info(self) -> ModelInfo: ...

    def generate(
        self, messages: Sequence[Message], settings: GenerationSettings, probes: ProbeSettings
    ) -> Iterator[Event]: ...

    @property
    def pacer(self) -> Pacer: ...

    def cancel(self) -> None: ...

    def reset(self) -> None: ...

    def count_tokens(self, messages: Sequence[Message]) -> int: ...


ProgressCallback = Callable[[str, float], None]
Loader = Callable[..., Any]  # (LoadRequest, progress=ProgressCallback) -> loaded model
SessionFactory = Callable[[Any], Session]
Push = Callable[[list[Event]], None]


def default_loader(request: LoadRequest, progress: ProgressCallback) -> Any:
    # Imported on first use, where the engine runs: torch takes seconds to import.
    from engine.load.loader import load_model

    return load_model(request, progress=progress)


def default_session_factory(loaded: Any) -> Session:
    from engine.generate.session import ChatSession

    return ChatSession(loaded)


def event_weight(event: Event) -> int:
    """Roughly what an event costs its listeners: attention rows dominate at long contexts."""
    attention = getattr(event, "attention", None)
    return EVENT_WEIGHT + (sum(a.nbytes for a in attention.values()) if attention else 0)


def proposed_request(request: LoadRequest, error: BaseException) -> LoadRequest | None:
    """The load `request` placed as a failed load's error proposes (ModelLoadError.fits_as),
    or None. The fast model places layers between RAM and disk only: a proposal of layers on
    a GPU goes to the exact path."""
    fits_as = getattr(error, "fits_as", None)
    if fits_as is None or not fits_as.device_map:  # no placement would fit either
        return None
    precision = request.precision
    if precision == "fast" and fits_as.device_map.startswith("gpu-layers"):
        precision = "auto"
    return replace(
        request,
        device_map=fits_as.device_map,
        max_memory=fits_as.max_memory,
        precision=precision,
    )


def explained(error: BaseException) -> bool:
    """Whether the error is one the loader explains in the user's terms (a wrong path, a file
    it cannot read, a model that does not fit), not a fault of the program. By name: the
    engine's side (and torch) is imported only where a model is loaded."""
    return type(error).__name__ == "ModelLoadError" and bool(str(error).strip())


def describe_error(error: BaseException) -> str:
    """A one-line message for the user; load errors already read as sentences."""
    text = str(error).strip()
    if explained(error):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def throttled(
    progress: ProgressCallback, interval_s: float = PROGRESS_INTERVAL_S
) -> ProgressCallback:
    """`progress`, called at most once per `interval_s` per stage (stage changes and 1.0 pass)."""
    last: dict[str, Any] = {"stage": None, "time": 0.0}

    def report(stage: str, fraction: float) -> None:
        now = time.monotonic()
        if stage == last["stage"] and fraction < 1 and now - last["time"] < interval_s:
            return
        last.update(stage=stage, time=now)
        progress(stage, float(fraction))

    return report


def load_session(
    loader: Loader,
    session_factory: SessionFactory,
    request: LoadRequest,
    progress: ProgressCallback,
) -> Session:
    """Load `request` and open a session on it; errors propagate (the caller reports them)."""
    loaded = loader(request, progress=throttled(progress))
    session = session_factory(loaded)
    session.info  # noqa: B018 - a session without info is not usable: fail the load now
    return session


def run_generation(
    session: Session | None,
    messages: Sequence[Message],
    settings: GenerationSettings,
    probes: ProbeSettings,
    push: Push,
    cancelled: Callable[[], bool],
) -> None:
    """Run one reply, pushing its events; `cancelled()` says Stop was pressed for it."""
    started = time.perf_counter()
    if session is None:
        push(failure("no model is loaded", "RuntimeError", "", started))
        return
    if cancelled():  # Stop pressed before the job even started
        push([finished_early("cancelled", "", started)])
        return
    text: list[str] = []
    try:
        for event in session.generate(messages, settings, probes):
            if isinstance(event, Token):
                text.append(event.text)
            push([event])
            if isinstance(event, Finished):
                return
            if cancelled():
                # A stop that raced the session's own start (which may clear its flag).
                session.cancel()
    except Exception as error:
        log.exception("generation failed")
        push(failure(describe_error(error), type(error).__name__, "".join(text), started))
        return
    # The contract says a generation ends with Finished; keep the GUI consistent if not.
    push(failure("the generation ended early", "RuntimeError", "".join(text), started))


def finished_early(reason: FinishReason, text: str, started: float) -> Finished:
    """A Finished for a reply that never reached the model (or left it without one)."""
    return Tally(started=started).finished(reason, text)


def failure(message: str, error_type: str, text: str, started: float) -> list[Event]:
    return [Failed(message=message, error_type=error_type), finished_early("error", text, started)]


class ReplyTally:
    """What a reply's events said so far, so a reply cut off with its engine can still end
    with an honest Finished: the text streamed, tokens and times as the engine measured them."""

    def __init__(self) -> None:
        self.tally = Tally(started=time.perf_counter())
        self.text: list[str] = []

    def add(self, event: Event) -> None:
        if isinstance(event, PrefillDone | Token):
            self.tally.add(event)
        if isinstance(event, Token):
            self.text.append(event.text)

    def cut_off(self, message: str, error_type: str) -> list[Event]:
        """Failed, then the Finished of a reply that ended here."""
        finished = self.tally.finished("error", "".join(self.text))
        return [Failed(message=message, error_type=error_type), finished]
