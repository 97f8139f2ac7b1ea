"""The protocol between the window and the engine server: typed messages, each carrying its job.

Every request that starts work in the engine names a job: an id the client picks, unique for
the engine's lifetime, that every reply about that work carries back. The server runs jobs in
the order they arrive and owns their state (which one runs, which were cancelled); the client
only remembers what it asked for, by id, to match the replies.

  requests, client -> server            replies, server -> client
  Load(job, request)                    Ready()                      the server is up
  Generate(job, messages, settings,     Progress(job, stage, fraction) throttled
      probes, stream)                   Loaded(job, info) / LoadFailed(job, message,
                                            fits_as)  fits_as: the request placed so it fits
  Cancel(job)    all jobs up to `job`   Events(job, events, queued_at) engine events, unchanged
  Pace(action, rate)  pause / step /    Held(job, held)  the reply is held by a pause (True)
      resume / play at `rate` tokens a second              or goes on (False), after the
                                                           events it sent before
  Watch(layers, interval_s, grid)       Events(job, (StepRows,))  the latest step's rows of the
      the layers a visible panel draws,       watched layers, at most every interval_s (and
      how often it draws them and the         the last step's before a hold or the end);
      cells its mosaic has room for           with a grid, PromptCells after the PrefillDone
                                              and the prompt's rows before a hold or the end
  Fetch(step, layers, prompt)  a step's Events(job, (StepRows,))  that step's rows, or aged_out
      rows (or the prompt's matrix),
      from the engine's ring
  WatchLens(on)  keep each step's       Lensed(job, lens)            a step's LayerLens (None:
      per-layer residuals or stop                                    that step was not kept)
  AskLens(job, step, top)  a step's
      logit lens, computed on asking
  Reset(job)                            Counted(job, tokens)
  Count(job, messages)                  DecodeStep(job, state)       after Loaded: the compiled
  Quit()                                                             step attached, or why not
                                        Done(job)                    a job ended (any kind)

`Cancel`, `Pace`, `Watch`, `Fetch`, `WatchLens`, `AskLens` and `Quit` are not queued: the
server acts on them as they arrive, so Stop reaches a running reply within one step, Next
token a held one at once, and rows or a lens are answered while a reply runs or is held. A
`Generate` with `stream=False` sends only the reply's end (Failed, Finished): its events stay in
the engine (a reference reply for a benchmark, or a caller that wants the result only).

The messages travel over a transport (`Transport`): a pipe to the engine's child process
(app.server.engine_process), or in-memory queues to a server in a thread of this process
(app.server.engine_thread). Qt-free and light: the window's process imports it before the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.events import Event, LayerLens, ModelInfo
    from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

ALL_JOBS = 2**62  # Cancel(ALL_JOBS) cancels whatever runs or waits


# -- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    job: int
    request: LoadRequest


@dataclass(frozen=True)
class Generate:
    job: int
    messages: tuple[Message, ...]
    settings: GenerationSettings
    probes: ProbeSettings
    stream: bool = True  # False: only the reply's Failed and Finished cross


@dataclass(frozen=True)
class Cancel:
    job: int  # this job and every earlier one


@dataclass(frozen=True)
class Reset:
    job: int


@dataclass(frozen=True)
class Count:
    job: int
    messages: tuple[Message, ...]


@dataclass(frozen=True)
class Quit:
    """End the server once the running job stopped (not a job: nothing answers it)."""


PACE_ACTIONS = ("pause", "step", "resume", "play")


@dataclass(frozen=True)
class Pace:
    """The session's pacer (engine/generate/pacing.py): a teacher's Pause, Next token, Resume or
    Play slowly at `rate` tokens a second. About the session, not a job: it outlasts replies."""

    action: str  # one of PACE_ACTIONS
    rate: float = 0.0

    def __post_init__(self) -> None:
        if self.action not in PACE_ACTIONS:
            raise ValueError(f"pace {self.action!r}: one of {', '.join(PACE_ACTIONS)}")
        if self.action == "play" and not self.rate > 0:
            raise ValueError(f"play at {self.rate} tokens a second: it must be above 0")


@dataclass(frozen=True)
class Watch:
    """Which layers' attention rows a visible panel draws, and how often (seconds between its
    frames): the server sends the latest step's rows of those layers no more often than that.
    No layers: no rows cross, only the per-token statistics. About the session: it outlasts
    replies."""

    layers: tuple[int, ...] = ()
    interval_s: float = 0.033
    # The most cells (rows, keys) the panel's mosaic draws a head's rows in: a prompt's matrix
    # then crosses pooled near that grid (PromptCells), its rows only when the reply ends or
    # is held, or when asked (Fetch with `prompt`). None: the rows cross with the PrefillDone.
    grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class Cadence:
    """How often the client takes a reply's events in (seconds between its deliveries): a
    reply's later tokens then cross no more often than that, a few a message, rather than at
    the outbox's default rate, which would wake the client's receiving thread for events it
    only hands on at its next delivery. About the session, like Watch."""

    interval_s: float


@dataclass(frozen=True)
class Fetch:
    """The rows of step `step` of the latest reply (a selected or stepped-to token), from the
    engine's ring; answered as the reply's Events with one StepRows (aged_out if gone)."""

    step: int
    layers: tuple[int, ...] = ()  # () : every watched layer the ring holds
    prompt: bool = False  # the prompt's matrix (step 0), which crossed pooled


@dataclass(frozen=True)
class WatchLens:
    """Keep each step's per-layer residuals for the logit lens from the next pass on (True),
    or stop (False): about the session, like Pace; only a visible Layers panel wants it."""

    on: bool


@dataclass(frozen=True)
class AskLens:
    """The logit lens of step `step` of the latest reply, answered by `Lensed(job, ...)` as it
    arrives (also while that reply runs or is held by a pause); `job` is the asker's id."""

    job: int
    step: int
    top: int = 10


Request = (
    Load
    | Generate
    | Cancel
    | Pace
    | Watch
    | Cadence
    | Fetch
    | WatchLens
    | AskLens
    | Reset
    | Count
    | Quit
)


# -- replies -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """The server imported what it needs and takes jobs (not a job's reply)."""


@dataclass(frozen=True)
class Progress:
    job: int
    stage: str
    fraction: float


@dataclass(frozen=True)
class Loaded:
    job: int
    info: ModelInfo


@dataclass(frozen=True)
class LoadFailed:
    job: int
    message: str  # one line for the user; the previous model stays loaded
    # For a model too big for where it was asked to run: the same request, placed so that it
    # fits (engine/placement/plan.py's proposal); None for any other failure.
    fits_as: LoadRequest | None = None


@dataclass(frozen=True)
class Events:
    job: int
    events: tuple[Event, ...]
    queued_at: float = 0.0  # time.monotonic() when the oldest of them was queued to cross


@dataclass(frozen=True)
class Counted:
    job: int
    tokens: int | None  # None: no model, or the count failed


@dataclass(frozen=True)
class DecodeStep:
    job: int  # the load whose model it is
    state: str  # "compiled", or "eager: why"


@dataclass(frozen=True)
class Held:
    """The reply `job` is held by a pause (True: the engine waits on its pacer, using no CPU)
    or goes on (False). Sent in order with its events: every token made before the hold
    arrives first."""

    job: int
    held: bool


@dataclass(frozen=True)
class Lensed:
    job: int  # the AskLens it answers
    lens: LayerLens | None  # None: no model, or the step was not kept


@dataclass(frozen=True)
class Done:
    job: int


Reply = (
    Ready | Progress | Loaded | LoadFailed | Events | Counted | DecodeStep | Held | Lensed | Done
)


class Transport(Protocol):
    """The client's end of one engine server: requests in, replies out."""

    def send(self, request: Request) -> bool:
        """Deliver a request; False if the server is gone."""
        ...

    def receive(self) -> tuple[Reply, int]:
        """The next reply and the bytes it took (0 in memory); EOFError once the server is
        gone. Called from one thread only, the client's receiver."""
        ...

    def is_alive(self) -> bool: ...

    def why_stopped(self) -> str:
        """One line for the user on how a server that ended unasked ended."""
        ...

    def stop(self, timeout_s: float, patient: bool = True) -> None:
        """Cancel, ask the server to quit and wait for it; nothing is left running after.
        `patient=False`: it is importing or loading, which loses nothing if cut short."""
        ...

    def close(self) -> None:
        """Release the channel once nobody reads or writes it (after `stop` or an end)."""
        ...

    def again(self) -> Transport:
        """A fresh server started as this one was (after this one died)."""
        ...
