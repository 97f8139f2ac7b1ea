"""Turn one step's logits into the next token: repetition penalty, temperature, top-k, top-p.

The order and the arithmetic follow transformers' logits processors, so a seeded run is
reproducible and greedy decoding picks exactly what `model.generate(do_sample=False)` picks.
"""

from __future__ import annotations

import random

import torch

from engine.model.largest import argmax, top_k_support
from engine.settings import GenerationSettings
from engine.weights import ggml_kernel


class Sampler:
    """Chooses tokens for one generation; holds its seeded random generator."""

    def __init__(self, settings: GenerationSettings, device: torch.device) -> None:
        self.settings = settings
        self.seed = settings.seed if settings.seed is not None else random.randrange(2**31)
        self.generator = torch.Generator(device=device).manual_seed(self.seed)
        # On a GPU the filters run over the whole vocabulary: nothing there waits for the host
        # (the CPU's shortcuts below pick indices with nonzero, a sync on a GPU).
        self.on_device = device.type == "cuda"
        # (probs, what `distribution` found for them): greedy's argmax, or the support a
        # sampled step's filters kept; `choose` reads it instead of passing over the vocabulary
        self._found: tuple[torch.Tensor, torch.Tensor] | None = None

    def draw(
        self, logits: torch.Tensor, history: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The distribution the token is drawn from and the token (0-d, on the device); greedy
        has no distribution to name (None: all of it on the token), so none is written: a
        vocabulary of zeros each step cost a fast model's step more than its argmax."""
        if self.settings.greedy:
            scores = penalize_repetition(logits, history, self.settings.repetition_penalty)
            return None, argmax(scores)
        probs = self.distribution(logits, history)
        return probs, self.choose(probs)

    def distribution(self, logits: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The probabilities the next token is drawn from. logits: [vocab] float32; history: [n]."""
        s = self.settings
        scores = penalize_repetition(logits, history, s.repetition_penalty)
        if s.greedy:  # all the probability on the likeliest token
            best = argmax(scores)
            probs = torch.zeros_like(scores).index_fill_(0, best, 1.0)
            self._found = (probs, best)
            return probs
        if 0 < s.top_k < scores.numel() and not self.on_device:
            fused = fused_filters(scores, s.temperature, s.top_k, s.top_p)
            if fused is not None:
                self._found = fused
                return fused[0]
        scores = scores / s.temperature
        if self.on_device:
            return torch.softmax(keep_top_p(keep_top_k(scores, s.top_k), s.top_p), dim=-1)
        if 0 < s.top_k < scores.numel():
            kept = top_k_support(scores, s.top_k)
            probs = _within(scores, kept, s.top_p)
            self._found = (probs, kept)
            return probs
        scores = keep_top_p(scores, s.top_p)
        return torch.softmax(scores, dim=-1)

    def choose(self, probs: torch.Tensor) -> torch.Tensor:
        """A 0-d tensor holding the chosen token id (still on the device).

        Drawn among the tokens the filters kept: torch's multinomial costs with the tokens it
        draws among, a whole vocabulary far more than the default top-k's 50.
        The same distribution, drawn from with the same seeded generator."""
        found = self._found[1] if self._found is not None and self._found[0] is probs else None
        if self.settings.greedy:
            return found if found is not None else argmax(probs)
        if self.on_device:  # no support to find: the draw stays on the device
            return torch.multinomial(probs, 1, generator=self.generator)[0]
        support = found if found is not None else probs.nonzero()[:, 0]
        weights = probs[support]
        pick = draw_one(weights, self.generator) if weights.numel() else None
        if pick is None or not bool(weights[pick] > 0):  # NaN, or nothing kept
            raise ValueError("no token to draw: the probabilities are not numbers, or all zero")
        return support[pick]


def draw_one(weights: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """An index of weights [n] (nonnegative, not all zero) drawn in proportion to them, as
    `torch.multinomial(weights, 1, generator=generator)[0]` draws it: its own way for one
    draw (the exponential race, the largest weight / q for q ~ Exp(1)), the same index from the
    same generator, without its checks over every weight (three reductions and three waits for
    their results, most of its time for the few tokens a step keeps)."""
    race = torch.empty_like(weights).exponential_(1, generator=generator)
    return (weights / race).argmax()


def fused_filters(
    scores: torch.Tensor, temperature: float, k: int, p: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Temperature, top-k and top-p as `_within` applies them, and the support, in one
    call of the GGML kernels (a dozen small torch ops cost a fast model's step tens of
    microseconds each); None where they do not load, or where a score ties with the k-th."""
    usable = scores.device.type == "cpu" and scores.dtype == torch.float32 and scores.dim() == 1
    if not usable or ggml_kernel.ensure() is not None:
        return None
    probs, kept = torch.ops.glassbox.sample_filter(scores, temperature, k, p)
    return (probs, kept) if kept.numel() else None


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
    """Scores below the k-th largest set to -inf (ties with it kept), as transformers does."""
    if not 0 < k < scores.numel():
        return scores
    return scores.masked_fill(scores < scores.topk(k).values[-1], float("-inf"))


def _within(scores: torch.Tensor, kept: torch.Tensor, p: float) -> torch.Tensor:
    """softmax(keep_top_p(scores, p)) once every score but top-k's `kept` is -inf (the order
    and arithmetic of transformers' top-k then top-p), worked out on the kept tokens alone.

    Over the whole vocabulary, top-p sorted every score each step (a costly sort) of which all
    but the top k were already -inf, and those add nothing to its softmax or its sums.
    """
    probs = torch.zeros_like(scores)
    probs[kept] = torch.softmax(keep_top_p(scores[kept], p), dim=-1)
    return probs


def keep_top_p(scores: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability adds up to at least p."""
    if p >= 1.0:
        return scores
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - p)
    drop[-1] = False  # always keep the most likely token
    return scores.masked_fill(drop.scatter(0, order, drop), float("-inf"))
