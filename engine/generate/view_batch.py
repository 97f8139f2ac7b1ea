"""The live view's per-token work, done for several tokens at once.

Between two decode steps the CPU's caches hold the model's weights, not the view's code: each
small torch op the view runs there costs tens of microseconds, and a token's candidates,
per-head statistics and watched attention took some thirty-five of them. Done for the steps of
the last few tens of milliseconds together, the same ops serve every token in the batch (on a
GPU, the same number of launches and one copy back).

A step's Token waits here until its batch is finished: at most FLUSH_S, counted with the next
step's expected time, so the stream still updates 30 times a second. Token 0 (the time to
first token), a reply's last token and every token of a paced reply (a teacher's Next token,
Play slowly) are finished at once; a reply that records nothing for the view is never held.
The batch's time is shared among its tokens' `seconds`: a step's latency includes its part of
the view's work, as it did when each token did its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from engine.events import Attention, Candidate, Roofline, Token, frozen_array
from engine.generate.head_stats import batch_statistics
from engine.model import largest
from engine.model.step_ring import ATTENTION, StepRing

# (layer, queries [1, heads, n, d] of positions start.., start) -> weights [heads, n, keys]
WeighLater = Callable[[int, torch.Tensor, int], torch.Tensor]
# the same over a given cache: Glassbox's own model's `weigh`
Weigh = Callable[[int, torch.Tensor, int, Any], torch.Tensor]

FLUSH_S = 1 / 30  # the longest a token waits for its batch
MOST_STEPS = 32  # and the most tokens a batch holds (their logits stay alive until then)


@dataclass(frozen=True, slots=True)
class Step:
    """One decode step waiting for its view data."""

    token: Token  # as streamed, without candidates or statistics; `seconds` the step's own
    logits: torch.Tensor  # [vocab] float32
    probs: torch.Tensor | None  # the distribution sampled from [vocab]; None when greedy
    rows: dict[int, torch.Tensor]  # watched layer -> [heads, keys]: its query's attention
    roofline: Callable[[float], Roofline | None]  # the step on the roofline, given its time
    # watched layer -> the step's query [1, heads, 1, d], left for the batch to weigh
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    start: int = 0  # the step's position (its query's)


@dataclass
class ViewBatch:
    """Steps whose Token events are finished together (see the module's docstring)."""

    top_k: int  # candidates per token (0: none)
    watched: bool  # whether steps carry attention rows
    token_rows: bool  # whether each Token carries its rows (else they go to the ring only)
    ring: StepRing
    piece: Callable[[int], str]  # a token id's text
    greedy: bool
    weigh: WeighLater | None = None  # how queries left for later are weighed
    steps: list[Step] = field(default_factory=list)
    _oldest: float = 0.0  # when the first waiting step was added (perf_counter)

    @property
    def records(self) -> bool:
        """Whether the view wants anything of a step (else a token is never held)."""
        return self.top_k > 0 or self.watched

    def add(self, step: Step) -> None:
        if not self.steps:
            self._oldest = time.perf_counter()
        self.steps.append(step)

    def due(self, step_s: float, at_once: bool) -> bool:
        """Whether to finish the batch now: `at_once` (token 0, the last, a paced reply), or
        the next step (taking about `step_s`) would keep a token waiting past FLUSH_S."""
        if not self.steps:
            return False
        if at_once or len(self.steps) >= MOST_STEPS or not self.records:
            return True
        return time.perf_counter() + step_s - self._oldest > FLUSH_S

    def finish(self, clock: Callable[[], float]) -> list[Token]:
        """Every waiting step's Token, complete, in order; `clock()` is the seconds since the
        caller started timing the batch (synchronised with the device)."""
        steps, self.steps = self.steps, []
        if not steps:
            return []
        if not self.records:  # nothing for the view: the step's own time
            return [replace(s.token, roofline=s.roofline(s.token.seconds)) for s in steps]
        self._weigh_queries(steps)
        candidates = self._candidates(steps)
        statistics = batch_statistics([s.rows if s.token.index else {} for s in steps])
        for step in steps:
            if step.rows:
                self.ring.put(step.token.index, ATTENTION, step.rows)
        share = clock() / len(steps)
        return [
            replace(
                step.token,
                seconds=step.token.seconds + share,
                top_k=candidates[i],
                head_stats=statistics[i],
                attention=self._host_rows(step),
                roofline=step.roofline(step.token.seconds + share),
            )
            for i, step in enumerate(steps)
        ]

    def _candidates(self, steps: list[Step]) -> list[tuple[Candidate, ...]]:
        """Each step's `top_k` likeliest next tokens, from all the batch's logits at once."""
        if self.top_k <= 0:
            return [()] * len(steps)
        indices, probs = largest.top_k_softmax([s.logits for s in steps], self.top_k)
        ids = indices.tolist()
        if self.greedy:  # all the probability was on the chosen token
            chosen = [step.token.token_id for step in steps]
            sampled = [[float(i == c) for i in row] for row, c in zip(ids, chosen, strict=True)]
        else:
            sampled = [_probs(s)[row].tolist() for s, row in zip(steps, indices, strict=True)]
        return [
            tuple(
                Candidate(token_id=i, text=self.piece(i), prob=p, sampled_prob=q)
                for i, p, q in zip(row, top, drawn, strict=True)
            )
            for row, top, drawn in zip(ids, probs.tolist(), sampled, strict=True)
        ]

    def _weigh_queries(self, steps: list[Step]) -> None:
        """The queries the steps left for later, weighed a layer at a time for each run of
        consecutive positions: each step's row a view of the run's block."""
        weigh = self.weigh
        if weigh is None:
            return
        runs: list[list[Step]] = []
        for step in steps:
            if not step.queries:
                continue
            if runs and runs[-1][-1].start + 1 == step.start:
                runs[-1].append(step)
            else:
                runs.append([step])
        for run in runs:
            first = run[0].start
            for layer in sorted(run[0].queries):
                queries = torch.cat([step.queries[layer] for step in run], dim=2)
                block = weigh(layer, queries, first)  # [heads, n, first + n]
                for j, step in enumerate(run):
                    step.rows[layer] = block[:, j, : first + j + 1]

    def abandon(self) -> list[Token]:
        """The waiting steps' Tokens as streamed, without the view's data (a failed reply)."""
        steps, self.steps = self.steps, []
        return [step.token for step in steps]

    def _host_rows(self, step: Step) -> Attention:
        """The step's rows on the host, where each Token carries them (token 0's row is the
        prompt's last one, in the PrefillDone)."""
        if not self.token_rows or not step.token.index:
            return {}
        return {layer: frozen_array(row.cpu().numpy()) for layer, row in step.rows.items()}


def _probs(step: Step) -> torch.Tensor:
    """A sampled step's distribution (only a greedy step has none)."""
    assert step.probs is not None, "a sampled step keeps the distribution it was drawn from"
    return step.probs
