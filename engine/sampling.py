"""Turn one step's logits into the next token: repetition penalty, temperature, top-k, top-p.

The order and the arithmetic follow transformers' logits processors, so a seeded run is
reproducible and greedy decoding picks exactly what `model.generate(do_sample=False)` picks.
"""

from __future__ import annotations

import random

import torch

from engine.largest import argmax
from engine.settings import GenerationSettings


class Sampler:
    """Chooses tokens for one generation; holds its seeded random generator."""

    def __init__(self, settings: GenerationSettings, device: torch.device) -> None:
        self.settings = settings
        self.seed = settings.seed if settings.seed is not None else random.randrange(2**31)
        self.generator = torch.Generator(device=device).manual_seed(self.seed)

    def distribution(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The probabilities the next token is drawn from. logits: [vocab] float32; history: [n]."""
        s = self.settings
        scores = penalize_repetition(logits, history, s.repetition_penalty)
        if s.greedy:  # all the probability on the likeliest token
            return torch.zeros_like(scores).index_fill_(0, argmax(scores), 1.0)
        scores = scores / s.temperature
        scores = keep_top_k(scores, s.top_k)
        scores = keep_top_p(scores, s.top_p)
        return torch.softmax(scores, dim=-1)

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        """A 0-d tensor holding the chosen token id (still on the device)."""
        if self.settings.greedy:
            return argmax(probs)
        return torch.multinomial(probs, 1, generator=self.generator)[0]


def penalize_repetition(
    logits: torch.Tensor, history: torch.Tensor, penalty: float
) -> torch.Tensor:
    """Make tokens already in the context less likely (penalty > 1), as in CTRL."""
    if penalty == 1.0 or history.numel() == 0:
        return logits
    seen = logits.gather(0, history)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(0, history, seen)


def keep_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= scores.numel():
        return scores
    threshold = torch.topk(scores, k).values[-1]
    return scores.masked_fill(scores < threshold, float("-inf"))


def keep_top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p."""
    if p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p)
    drop[-1] = False  # always keep the most likely token
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
