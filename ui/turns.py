"""The window's heavy pieces of GUI-thread work, one per turn of the event loop.

Two timers start the window's heaviest work while a reply streams: the delivery of the engine's
events (app.client.delivery) and the panels' frame (ui.panels.docks). Each keeps to its own
budget, but timers that fall due together run back to back in one turn of the event loop, and
input, paint and every other timer then wait for their sum: with both on the same interval
they fell due together at most ticks. So each piece runs in `turns.piece()`, which notes when
a piece that took time ended, and a piece whose timer fires right after one ended
(`just_worked`) runs at the event loop's next turn instead, after what waited in between
(`take` does both).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from time import perf_counter

# Two pieces this close ran in one turn: starting the next timer's slot takes microseconds,
# and a turn that ran anything else in between (a paint, input) took longer.
SAME_TURN_S = 0.001
# How long a piece that gave way waits: a 1 ms timer is due only at a later turn (a zero-time
# one could run in the same turn as timers that fell due with it).
GIVE_WAY_MS = 1
# A piece shorter than this holds nothing up: the next need not give way to it (an idle tick).
LIGHT_S = 0.001


class Turns:
    """When the last heavy piece of GUI-thread work ended (shared by the pieces)."""

    def __init__(self) -> None:
        self._ended = -float("inf")

    @contextmanager
    def piece(self) -> Iterator[None]:
        """Run one piece of work; from LIGHT_S on, the next one gives way to it."""
        started = perf_counter()
        try:
            yield
        finally:
            ended = perf_counter()
            if ended - started >= LIGHT_S:
                self._ended = ended

    def just_worked(self) -> bool:
        """Whether one ended so recently that this turn of the event loop is still its own."""
        return perf_counter() - self._ended < SAME_TURN_S

    def take(self, work: Callable[[], None], later: Callable[[], None]) -> None:
        """Run `work` as a piece now, or, right after another piece, call `later` (which
        starts a GIVE_WAY_MS timer that tries again)."""
        if self.just_worked():
            later()
            return
        with self.piece():
            work()
