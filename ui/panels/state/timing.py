"""One reply's timing as the panels draw it: the engine's own tally plus each step's latency."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine.events import Finished, PrefillDone, Tally, Token
from ui.panels.state.arrays import GrowableArray


@dataclass
class ReplyTiming:
    """Timing of one reply, from its PrefillDone to its Finished.

    The totals live in an `engine.events.Tally`, filled from the events exactly as the engine
    fills its own, and every rate is `Finished`'s: the panels never compute a rate the status
    bar, the store or the terminal would not also show.
    """

    turn: str
    curve_label: str
    tally: Tally = field(default_factory=lambda: Tally(started=0.0))
    processed_tokens: int = 0
    first_token_s: float | None = None  # Token 0's seconds: prefill + sampling
    steps: GrowableArray = field(default_factory=lambda: GrowableArray(np.int64))
    step_seconds: GrowableArray = field(default_factory=lambda: GrowableArray(np.float64))
    finished: Finished | None = None
    error: str | None = None

    def add_prefill(self, event: PrefillDone) -> None:
        self.tally.add(event)
        self.processed_tokens = event.processed_tokens

    def add_token(self, event: Token) -> None:
        self.tally.add(event)
        if event.index == 0:
            self.first_token_s = event.seconds
        else:
            self.steps.append(event.index)
            self.step_seconds.append(event.seconds)

    @property
    def totals(self) -> Finished:
        """The reply's Finished, or while it streams the one it would end with now."""
        if self.finished is not None:
            return self.finished
        return self.tally.finished("length", "")

    # The numbers the timing panel reads, all from `totals`.

    @property
    def prompt_tokens(self) -> int:
        return self.tally.prompt_tokens

    @property
    def reused_tokens(self) -> int:
        return self.tally.reused_tokens

    @property
    def tokenize_s(self) -> float:
        return self.tally.tokenize_s

    @property
    def prefill_s(self) -> float:
        return self.tally.prefill_s

    @property
    def decode_s(self) -> float:
        return self.totals.decode_s

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.totals.prefill_tokens_per_s

    @property
    def decode_tokens_per_s(self) -> float:
        return self.totals.decode_tokens_per_s

    @property
    def ttft_s(self) -> float | None:
        ttft = self.totals.ttft_s
        return ttft if ttft > 0 else None

    @property
    def first_token_extra_s(self) -> float:
        """Sampling and overhead of the first token beyond the prefill pass."""
        if self.first_token_s is None:
            return 0.0
        return max(self.first_token_s - self.prefill_s, 0.0)
