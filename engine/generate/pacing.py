"""The pace of a generation: at full speed, held between steps, one step at a time, or slowed to
a rate, changed from any thread while it runs (a teacher's Pause, Next token, Play slowly).

The generation asks `wait()` before each step; the answer comes at once at full speed, and
otherwise when a step is granted, the slow rate's interval has passed or the reply is
cancelled. Work for the generation's own thread (`run_between_steps`: a logit lens asked for
while a reply runs) is done in `wait()`, before the next step or at once while held: torch's
operations from a second thread would start a second pool of OpenMP threads, and with more of
them than cores the pool waits at every barrier by sleeping instead of spinning, which halved
a two-core decode for as long as the engine ran. Waiting blocks on a condition (no spinning: a
paused engine holds no CPU), and the time spent waiting is returned so the generation can keep
it out of every timing. `on_hold`, if set, hears when a paused generation starts and stops being
held (the window shows it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from engine.settings import GenerationSettings, ProbeSettings

if TYPE_CHECKING:
    from engine.events import Event
    from engine.settings import Message

log = logging.getLogger(__name__)

Mode = Literal["run", "paused", "slow"]


@dataclass(frozen=True)
class Pace:
    """What the pacer is doing now: its mode, the slow rate (tokens a second), the steps
    granted but not yet taken, and whether a generation is held waiting for one."""

    mode: Mode
    rate: float
    granted: int
    waiting: bool


class Pacer:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._mode: Mode = "run"
        self._rate = 2.0
        self._granted = 0  # Next token presses not yet used by a step
        self._last_release = 0.0  # when the slow mode last let a step through (perf_counter)
        self._waiting = False
        self._errands: deque[Callable[[], None]] = deque()  # see run_between_steps
        # Told True when a paused generation is held, False when it goes on (the generation's
        # thread, outside the lock): the engine server sends it to the window.
        self.on_hold: Callable[[bool], None] | None = None

    # -- controls (any thread) ----------------------------------------------------------------

    def pause(self) -> None:
        """Hold the generation before its next step."""
        self._set("paused")

    def resume(self) -> None:
        """Full speed from here on."""
        self._set("run")

    def step(self) -> None:
        """Let one step through (Next token), leaving the generation paused after it."""
        with self._changed:
            if self._mode == "run":
                self._mode = "paused"
            self._granted += 1
            self._waiting = False  # until the held generation has taken the step
            self._changed.notify_all()

    def play(self, rate: float) -> None:
        """One step every 1/rate seconds (Play slowly)."""
        if not rate > 0:
            raise ValueError(f"a rate of {rate} tokens a second: it must be above 0")
        with self._changed:
            self._mode, self._rate = "slow", rate
            self._changed.notify_all()

    def wake(self) -> None:
        """Wake a waiting generation so that it sees its cancel flag (Stop works at any point)."""
        with self._changed:
            self._changed.notify_all()

    @property
    def pace(self) -> Pace:
        with self._changed:
            return Pace(self._mode, self._rate, self._granted, self._waiting)

    @property
    def at_full_speed(self) -> bool:
        """Whether steps run as fast as they can (not paused, stepped or slowed)."""
        with self._changed:
            return self._mode == "run"

    def run_between_steps(self, errand: Callable[[], None]) -> None:
        """Run `errand` in the generation's thread at its next wait: before its next step, or
        at once while it is held (any thread). The time it takes is waiting time, kept out of
        the steps' timings. One queued after the generation's last wait runs at `run_errands`."""
        with self._changed:
            self._errands.append(errand)
            self._changed.notify_all()

    def run_errands(self) -> None:
        """Run the errands queued, in order, in this thread (the generation's, or the engine's
        once a reply has ended). One that fails is logged: the reply it ran beside goes on."""
        while True:
            with self._changed:
                if not self._errands:
                    return
                errand = self._errands.popleft()
            try:
                errand()
            except Exception:
                log.exception("work run between two steps failed")

    # -- the generation's side ------------------------------------------------------------------

    def wait(self, cancelled: threading.Event) -> float:
        """Block until the next step may run (or `cancelled` is set); the seconds waited."""
        started = time.perf_counter()
        held = False  # as last told to on_hold
        while True:
            self.run_errands()
            with self._changed:
                delay = None if cancelled.is_set() else self._delay(time.perf_counter())
                self._waiting = delay is not None
                if delay is None:
                    break
                holding = self._mode == "paused"
                if holding == held:
                    if not self._errands:
                        self._changed.wait(timeout=delay)
                    continue
            held = holding
            self._tell(held)  # outside the lock: the listener may take locks of its own
        if held:
            self._tell(False)
        return time.perf_counter() - started

    def _tell(self, held: bool) -> None:
        if self.on_hold is not None:
            self.on_hold(held)

    def _delay(self, now: float) -> float | None:
        """None when a step may run now (and take what lets it), else how long to wait at
        most before looking again (a paused wait has no end but a control's notify)."""
        if self._mode == "run":
            return None
        if self._granted > 0:
            self._granted -= 1
            return None
        if self._mode == "slow":
            due = self._last_release + 1 / self._rate
            if now >= due:
                self._last_release = now
                return None
            return due - now
        return 3600.0  # paused: woken by a control

    def _set(self, mode: Mode) -> None:
        with self._changed:
            self._mode = mode
            if mode == "run":
                self._granted = 0
                self._waiting = False
            self._changed.notify_all()


class PacedGeneration:
    """What a session shares with app.bench.synthetic's stand-in: a reply is stopped (`cancel`)
    and paced (`pacer`) from any thread, and generate() fills in the default settings."""

    def __init__(self) -> None:
        self._cancel = threading.Event()
        self.pacer = Pacer()  # a teacher's Pause / Next token / Play slowly

    def cancel(self) -> None:
        """Ask the running generation to stop after the current step (any thread), also
        while its pacer holds it."""
        self._cancel.set()
        self.pacer.wake()

    def generate(
        self,
        messages: Sequence[Message],
        settings: GenerationSettings | None = None,
        probes: ProbeSettings | None = None,
    ) -> Iterator[Event]:
        """Generate a reply to `messages`, yielding events; always ends with one Finished."""
        self._cancel.clear()  # when the reply starts: a cancel before it is lost
        yield from self._generate(
            messages, settings or GenerationSettings(), probes or ProbeSettings()
        )

    def _generate(
        self, messages: Sequence[Message], settings: GenerationSettings, probes: ProbeSettings
    ) -> Iterator[Event]:
        raise NotImplementedError
