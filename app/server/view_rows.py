"""What crosses of a reply's attention rows: only what a visible panel draws, or asks for.

Per token the engine's events carry the per-head statistics the overview plots
(Token.head_stats); the rows themselves stay in the session's ring of recent steps
(engine/model/step_ring.py). `ViewRows` is the engine server's side of the window's pull:
  - `Watch(layers, interval_s)`: the latest step's rows of those layers cross at most every
    `interval_s`, and the last step's always before a hold or the reply's end, so a paused or
    finished reply shows its last step;
  - `Fetch(step)`: one step's rows now (a selected token), or StepRows(aged_out=True);
  - a prompt's matrix crosses with its PrefillDone only for the watched layers (the layer the
    attention panel shows); a layer watched later gets its prompt rows from the ring then
    (StepRows with `prompt`), so the other layers' matrices never cross unless looked at;
  - with the Watch's `grid` (the cells the panel's mosaic has room for), the watched layers'
    prompt matrices cross pooled near that grid instead (PromptCells: ~0.8 MB where the rows
    of a 1,000-token prompt are 10 MB, which the window would otherwise read and pool
    while the model decodes), and their rows follow before a hold or the reply's end, when
    the model waits, or at once when the window asks (`Fetch(0, prompt=True)`: a hovered
    prompt cell, a selected prompt token, a grid the cells cannot be pooled to).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from app.server.jobs import event_weight
from app.server.wire import Events, Fetch, Reply, Watch
from engine.attention_pooling import pool_prompt
from engine.events import (
    Attention,
    Event,
    PooledBlock,
    PrefillDone,
    PromptCells,
    StepRows,
    Token,
)
from engine.model.step_ring import PROMPT, StepRing, host_rows

Put = Callable[[Reply, int], None]  # (reply, weight): to the outbox


class ViewRows:
    """The window's watch, and the rows sent for it; any thread (a lock guards the state)."""

    def __init__(self, put: Put) -> None:
        self._put = put
        self._lock = threading.Lock()
        self.layers: frozenset[int] = frozenset()
        self.interval_s = Watch().interval_s
        self.grid: tuple[int, int] | None = None
        # (job, layer -> rows) of a prompt that crossed pooled, its rows not sent yet: kept here,
        # not looked up in the ring, whose cap lets step 0 go first during a long reply
        self._owed: tuple[int, Attention] | None = None
        self._sent_at = -math.inf
        self._unsent: tuple[int, int] | None = None  # (job, step) of rows not yet sent
        self.sent = 0  # StepRows sent as a panel's latest (tests and benchmarks read it)

    def watch(self, request: Watch, job: int = 0, ring: StepRing | None = None) -> None:
        """Watch `request.layers` from now on. A layer not watched before gets the prompt's
        matrix of reply `job` from `ring` first (where it is still there), then the latest
        step's rows, so a panel that switches layers draws the new one's whole buffer."""
        with self._lock:
            added = frozenset(request.layers) - self.layers
            if added and ring is not None and job:
                self._catch_up(job, added, ring)
            self.layers = frozenset(request.layers)
            self.interval_s = max(request.interval_s, 0.0)
            self.grid = request.grid
            self._sent_at = -math.inf  # the next token's rows go at once

    def _catch_up(self, job: int, layers: frozenset[int], ring: StepRing) -> None:
        """The prompt's rows of `layers`, then the latest step's: before any later row of
        theirs (the caller holds the lock that `after` takes to send one)."""
        prompt = _prompt_rows(ring, layers)
        if prompt is not None:
            self._send(job, prompt)
        latest = ring.latest
        if latest:  # step 0's row is the prompt's last: in the matrix already
            rows = host_rows(ring, latest, layers)
            if rows:
                self._send(job, StepRows(latest, rows, latest=True))

    def start_reply(self) -> None:
        """A new reply: a step still unsent belongs to the last one's numbering."""
        with self._lock:
            self._unsent = None
            self._owed = None

    def outgoing(
        self, events: Sequence[Event], pull: bool, ring: StepRing | None = None, job: int = 0
    ) -> list[Event]:
        """`events` as they cross. `pull` (the Generate's ProbeSettings.token_rows is False:
        the client pulls rows): a prompt's matrix only for the watched layers, pooled where
        the watch gives a grid, and, for a layer watched while the prompt was processed, from
        `ring` just after it. Otherwise the events carry every row as the generation made them
        (the old contract)."""
        if not pull:
            return list(events)
        layers = self.layers
        out: list[Event] = []
        for event in events:
            event = _only(event, layers)
            if not isinstance(event, PrefillDone):
                out.append(event)
                continue
            late = layers - set(event.attention)  # watched while the prompt was processed
            cells = None
            if self.grid is not None:
                event, cells = self._pooled(job, event, self.grid)
            out.extend([event] if cells is None else [event, cells])
            prompt = _prompt_rows(ring, late) if late and ring is not None else None
            if prompt is not None:
                out.append(prompt)
        return out

    def _pooled(
        self, job: int, event: PrefillDone, grid: tuple[int, int]
    ) -> tuple[PrefillDone, PromptCells | None]:
        """The PrefillDone without the matrices that pool smaller at `grid`, and their cells;
        their rows are owed to the window from then on (see `send_owed`)."""
        pooled: dict[int, PooledBlock] = {}
        for layer, block in event.attention.items():
            cells = pool_prompt(block, grid)
            if cells is not None:
                pooled[layer] = cells
        if not pooled:
            return event, None
        with self._lock:
            self._owed = (job, {layer: event.attention[layer] for layer in pooled})
        kept = {layer: rows for layer, rows in event.attention.items() if layer not in pooled}
        return replace(event, attention=kept), PromptCells(pooled)

    def send_owed(self) -> bool:
        """Send the prompt's rows that crossed pooled (the model waits now: a hold, the end,
        or the window asked); False if none were owed."""
        with self._lock:
            owed, self._owed = self._owed, None
        if owed is None:
            return False
        job, rows = owed
        self._send(job, StepRows(0, rows, prompt=True))
        return True

    def after(self, job: int, events: Sequence[Event], ring: StepRing | None) -> None:
        """Tokens went out: send the latest one's rows if a frame's interval has passed."""
        tokens = [event.index for event in events if isinstance(event, Token) and event.index]
        if not tokens or ring is None:
            return
        with self._lock:
            if not self.layers:
                self._unsent = None
                return
            self._unsent = (job, tokens[-1])
            due = time.monotonic() - self._sent_at >= self.interval_s
        if due:
            self.flush(ring)

    def flush(self, ring: StepRing | None) -> None:
        """Send the latest step's rows now if they have not crossed (before a hold, an end)."""
        with self._lock:
            unsent, self._unsent = self._unsent, None
            layers = self.layers
            if unsent is None or ring is None or not layers:
                return
            self._sent_at = time.monotonic()
        job, step = unsent
        rows = host_rows(ring, step, layers)
        if rows:
            self._send(job, StepRows(step, rows, latest=True))
            self.sent += 1

    def fetch(self, job: int, request: Fetch, ring: StepRing | None) -> None:
        """Answer a Fetch with the step's rows from the ring, or say they aged out."""
        if request.prompt:
            self._send_prompt(job, request, ring)
            return
        layers = frozenset(request.layers) or None
        rows = host_rows(ring, request.step, layers) if ring is not None else None
        if rows is None:
            self._send(job, StepRows(request.step, {}, aged_out=True))
        else:
            self._send(job, StepRows(request.step, rows))

    def _send_prompt(self, job: int, request: Fetch, ring: StepRing | None) -> None:
        """The prompt's rows asked for: those that crossed pooled, else the watched layers'
        from the ring (or aged_out)."""
        if not request.layers and self.send_owed():
            return
        layers = frozenset(request.layers) or self.layers
        prompt = _prompt_rows(ring, layers) if ring is not None else None
        self._send(job, prompt if prompt is not None else _aged_prompt())

    def _send(self, job: int, rows: StepRows) -> None:
        self._put(Events(job, (rows,), time.monotonic()), event_weight(rows))


def _prompt_rows(ring: StepRing, layers: frozenset[int]) -> StepRows | None:
    """The prompt's matrix of `layers` from `ring`, as it crosses (None: not kept)."""
    prompt = host_rows(ring, 0, layers, PROMPT)
    return StepRows(0, prompt, prompt=True) if prompt else None


def _aged_prompt() -> StepRows:
    """The prompt's rows are no longer in the ring (a new reply, or evicted)."""
    return StepRows(0, {}, aged_out=True, prompt=True)


def _only(event: Event, layers: frozenset[int]) -> Event:
    if not isinstance(event, PrefillDone | Token) or not event.attention:
        return event
    if all(layer in layers for layer in event.attention):
        return event
    kept = {layer: rows for layer, rows in event.attention.items() if layer in layers}
    return replace(event, attention=kept)


def ring_of(session: Any) -> StepRing | None:
    """The session's ring of recent steps (None: a session without one)."""
    ring = getattr(session, "steps", None)
    return ring if isinstance(ring, StepRing) else None
