"""The sampler's arithmetic: repetition penalty, top-k, top-p, greedy and seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor, TopKLogitsWarper, TopPLogitsWarper

from engine.generate import sampling
from engine.generate.sampling import Sampler, keep_top_p, penalize_repetition
from engine.settings import GenerationSettings
from engine.weights import ggml_kernel

CPU = torch.device("cpu")


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def kept(scores: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(scores)).flatten().tolist())


def test_repetition_penalty_by_hand():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -4.0])
    history = torch.tensor([0, 1, 1, 4])  # a repeated token is penalised once
    penalized = penalize_repetition(logits, history, 2.0)
    # Positive scores are divided by the penalty, negative ones multiplied: both less likely.
    assert penalized.tolist() == [1.0, -2.0, 0.5, 3.0, -8.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, -4.0]  # the input is left alone


def test_repetition_penalty_below_one_favours_repeats():
    penalized = penalize_repetition(torch.tensor([2.0, -1.0, 1.0]), torch.tensor([0, 1]), 0.5)
    assert penalized.tolist() == [4.0, -0.5, 1.0]


def test_repetition_penalty_matches_transformers():
    torch.manual_seed(0)
    logits = torch.randn(100)
    history = torch.randint(0, 100, (30,))
    expected = RepetitionPenaltyLogitsProcessor(1.3)(history[None], logits[None].clone())[0]
    torch.testing.assert_close(penalize_repetition(logits, history, 1.3), expected)


def test_repetition_penalty_off_or_no_history_is_identity():
    logits = torch.tensor([1.0, -2.0])
    assert penalize_repetition(logits, torch.tensor([0, 1]), 1.0) is logits
    assert penalize_repetition(logits, torch.tensor([], dtype=torch.long), 1.5) is logits


def keep_top_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """transformers' top-k filter: the reference the sampler's top-k is held to."""
    return TopKLogitsWarper(k)(None, scores[None].clone())[0]


NO_HISTORY = torch.tensor([], dtype=torch.long)


@pytest.mark.parametrize("size", [50, 1280])  # torch's topk, and the two-pass one
@pytest.mark.parametrize("k", [1, 3, 7])
def test_top_k_keeps_exactly_k(k, size):
    torch.manual_seed(k)
    scores = torch.randn(size)
    settings = GenerationSettings(temperature=1.0, top_k=k, top_p=1.0)
    probs = Sampler(settings, CPU).distribution(scores, NO_HISTORY)
    assert kept(probs.log()) == set(torch.topk(scores, k).indices.tolist())
    assert kept(probs.log()) == kept(keep_top_k(scores, k))
    survivors = probs > 0  # drawn in proportion to their unchanged scores
    torch.testing.assert_close(probs[survivors], torch.softmax(scores[survivors], dim=0))


@pytest.mark.parametrize("k", [0, 50, 80])
def test_top_k_off_or_wider_than_vocab_keeps_all(k):
    scores = torch.randn(50)
    settings = GenerationSettings(temperature=1.0, top_k=k, top_p=1.0)
    probs = Sampler(settings, CPU).distribution(scores, NO_HISTORY)
    torch.testing.assert_close(probs, torch.softmax(scores, dim=0))


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (0.05, {0}),  # the top token alone already passes p
        (0.45, {0}),
        (0.6, {0, 1}),
        (0.75, {0, 1}),
        (0.85, {0, 1, 2}),
        (0.99, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    probs = [0.5, 0.3, 0.15, 0.05]
    order = [2, 0, 3, 1]  # shuffled, so the filter cannot rely on the input order
    scores = probs_to_logits([probs[i] for i in order])
    filtered = keep_top_p(scores, p)
    assert {order[i] for i in kept(filtered)} == expected
    assert sum(probs[i] for i in expected) >= p - 1e-6


def test_top_p_always_keeps_the_top_token():
    scores = probs_to_logits([0.01, 0.97, 0.02])
    assert kept(keep_top_p(scores, 1e-9)) == {1}


def test_top_p_matches_transformers():
    torch.manual_seed(1)
    scores = torch.randn(200) * 3
    expected = TopPLogitsWarper(0.8)(None, scores[None].clone())[0]
    assert torch.equal(keep_top_p(scores, 0.8), expected)


def test_greedy_distribution_is_one_hot_at_argmax():
    torch.manual_seed(2)
    logits = torch.randn(100)
    sampler = Sampler(GenerationSettings(greedy=True), CPU)
    probs = sampler.distribution(logits, torch.tensor([], dtype=torch.long))
    argmax = int(logits.argmax())
    assert probs[argmax] == 1.0 and probs.sum() == 1.0
    assert int(torch.count_nonzero(probs)) == 1
    assert int(sampler.choose(probs)) == argmax


def test_greedy_applies_the_repetition_penalty_first():
    logits = torch.tensor([3.0, 2.0, 0.0])
    sampler = Sampler(GenerationSettings(greedy=True, repetition_penalty=2.0), CPU)
    probs = sampler.distribution(logits, torch.tensor([0]))  # 3.0 / 2 = 1.5 < 2.0
    assert int(sampler.choose(probs)) == 1


@pytest.mark.parametrize(
    "settings",
    [
        GenerationSettings(temperature=0.7, top_k=50, top_p=0.9),
        GenerationSettings(temperature=1.5, top_k=0, top_p=1.0),
        GenerationSettings(temperature=0.2, top_k=5, top_p=0.5, repetition_penalty=1.2),
        GenerationSettings(greedy=True),
    ],
)
def test_distribution_sums_to_one(settings):
    torch.manual_seed(3)
    logits = torch.randn(1000) * 4
    probs = Sampler(settings, CPU).distribution(logits, torch.arange(20))
    assert probs.shape == logits.shape
    assert math.isclose(float(probs.sum()), 1.0, abs_tol=1e-5)
    assert bool((probs >= 0).all())


def test_distribution_applies_temperature_then_filters():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    settings = GenerationSettings(temperature=0.5, top_k=2, top_p=1.0)
    probs = Sampler(settings, CPU).distribution(logits, torch.tensor([], dtype=torch.long))
    expected = torch.softmax(torch.tensor([4.0, 2.0]), dim=0)
    torch.testing.assert_close(probs[:2], expected)
    assert probs[2:].tolist() == [0.0, 0.0]


def test_seeded_sampler_is_reproducible():
    torch.manual_seed(4)
    logits = torch.randn(500)
    settings = GenerationSettings(temperature=1.0, top_k=0, top_p=1.0, seed=1234)

    def draws(sampler: Sampler) -> list[int]:
        probs = sampler.distribution(logits, torch.tensor([], dtype=torch.long))
        return [int(sampler.choose(probs)) for _ in range(20)]

    first = draws(Sampler(settings, CPU))
    assert first == draws(Sampler(settings, CPU))
    assert len(set(first)) > 1  # genuinely sampling, not stuck on one token
    other = GenerationSettings(temperature=1.0, top_k=0, top_p=1.0, seed=99)
    assert draws(Sampler(other, CPU)) != first


def test_unseeded_sampler_picks_and_keeps_a_seed():
    settings = GenerationSettings(seed=None)
    sampler = Sampler(settings, CPU)
    assert isinstance(sampler.seed, int)
    replay = Sampler(GenerationSettings(seed=sampler.seed), CPU)
    probs = torch.softmax(torch.randn(300), dim=0)
    assert [int(sampler.choose(probs)) for _ in range(10)] == [
        int(replay.choose(probs)) for _ in range(10)
    ]


def test_sampling_never_picks_a_filtered_token():
    logits = torch.tensor([5.0, 4.9, 4.8, -3.0, -3.0, -3.0])
    settings = GenerationSettings(temperature=2.0, top_k=3, top_p=1.0, seed=7)
    sampler = Sampler(settings, CPU)
    probs = sampler.distribution(logits, torch.tensor([], dtype=torch.long))
    picks = {int(sampler.choose(probs)) for _ in range(200)}
    assert picks <= {0, 1, 2} and len(picks) > 1


@pytest.mark.parametrize(
    "settings",
    [
        GenerationSettings(),  # the chat's defaults: temperature 0.7, top-k 50, top-p 0.9
        GenerationSettings(temperature=1.0, top_k=5, top_p=1.0),
        GenerationSettings(temperature=0.3, top_k=200, top_p=0.5, repetition_penalty=1.3),
    ],
)
def test_distribution_within_top_k_is_the_filters_over_the_whole_vocabulary(settings):
    """Top-p on the top-k tokens alone gives the probabilities the two filters give over every
    token. (Where scores tie at top-p's edge, which of them it keeps follows the sort's order of
    equal values, there as in transformers: arbitrary, so these scores do not tie.)"""
    generator = torch.Generator().manual_seed(5)
    history = torch.arange(0, 40_000, 97)
    for _trial in range(20):
        logits = torch.randn(49152, generator=generator) * 3
        probs = Sampler(settings, CPU).distribution(logits, history)
        scores = penalize_repetition(logits, history, settings.repetition_penalty)
        scores = scores / settings.temperature
        scores = keep_top_p(keep_top_k(scores, settings.top_k), settings.top_p)
        torch.testing.assert_close(probs, torch.softmax(scores, dim=-1), rtol=1e-5, atol=1e-7)
        assert set(probs.nonzero().flatten().tolist()) == kept(scores)


def test_ties_at_the_top_k_edge_are_all_kept():
    logits = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0] + [0.0] * 251)
    settings = GenerationSettings(temperature=1.0, top_k=2, top_p=1.0)
    probs = Sampler(settings, CPU).distribution(logits, torch.tensor([], dtype=torch.long))
    assert set(probs.nonzero().flatten().tolist()) == {0, 1, 2, 3}
    assert kept(keep_top_k(logits, 2)) == {0, 1, 2, 3}  # as transformers keeps them


def test_draws_follow_the_distribution_among_the_kept_tokens():
    """Drawn over the kept tokens alone: each token's share of 20,000 seeded draws is its
    probability (within 0.015), and a filtered token never comes."""
    logits = torch.zeros(49152)
    logits[[10, 2000, 30_000, 49_151]] = torch.tensor([3.0, 2.5, 2.0, 1.0])
    settings = GenerationSettings(temperature=1.0, top_k=4, top_p=1.0, seed=11)
    sampler = Sampler(settings, CPU)
    probs = sampler.distribution(logits, torch.tensor([], dtype=torch.long))
    draws = torch.tensor([int(sampler.choose(probs)) for _ in range(20_000)])
    counts = torch.bincount(draws, minlength=49152).float() / draws.numel()
    assert set(draws.unique().tolist()) == {10, 2000, 30_000, 49_151}
    torch.testing.assert_close(counts, probs, rtol=0, atol=0.015)


@pytest.mark.parametrize(
    "settings",
    [GenerationSettings(), GenerationSettings(temperature=0.3, top_k=7, top_p=0.5, seed=3)],
)
def test_the_on_device_path_draws_from_the_same_distribution(settings):
    """A GPU's sampler filters over the whole vocabulary and draws there (no host sync): the
    same probabilities as the CPU's shortcuts, and its draws among the kept tokens only."""
    generator = torch.Generator().manual_seed(7)
    history = torch.arange(0, 40_000, 97)
    on_device = Sampler(settings, CPU)
    on_device.on_device = True  # what a CUDA device sets
    for _trial in range(10):
        logits = torch.randn(49152, generator=generator) * 3
        want = Sampler(settings, CPU).distribution(logits, history)
        probs = on_device.distribution(logits, history)
        torch.testing.assert_close(probs, want, rtol=1e-5, atol=1e-7)
        assert float(probs[on_device.choose(probs)]) > 0


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
@pytest.mark.parametrize(
    "settings",
    [
        GenerationSettings(seed=0),  # the chat's defaults
        GenerationSettings(temperature=1.3, top_k=7, top_p=0.5, seed=1),
        GenerationSettings(temperature=0.2, top_k=200, top_p=0.99, seed=2),
        GenerationSettings(temperature=0.9, top_k=40, top_p=1.0, seed=3),
    ],
)
def test_the_kernels_filters_are_the_torch_ops_and_draw_the_same_tokens(settings, monkeypatch):
    """The one-call filters (`fused_filters`) give torch's probabilities (within float
    rounding), the same kept tokens and support, and so a seeded reply's same draws."""
    generator = torch.Generator().manual_seed(9)
    history = torch.arange(0, 40_000, 97)
    fused, torch_ops = Sampler(settings, CPU), Sampler(settings, CPU)
    drawn: tuple[list[int], list[int]] = ([], [])
    for step in range(300):
        logits = torch.randn(49152, generator=generator) * (1 + step / 100)
        probs = fused.distribution(logits, history)
        assert fused._found is not None and fused._found[0] is probs  # the kernel's way
        with monkeypatch.context() as patched:
            patched.setattr(sampling, "fused_filters", lambda *_: None)
            want = torch_ops.distribution(logits, history)
        assert torch.equal(probs.nonzero(), want.nonzero())
        torch.testing.assert_close(probs, want, rtol=1e-6, atol=0)
        assert torch.equal(fused._found[1], torch_ops._found[1])  # type: ignore[index]
        drawn[0].append(int(fused.choose(probs)))
        drawn[1].append(int(torch_ops.choose(want)))
    assert drawn[0] == drawn[1]
    assert len(set(drawn[0])) > 10


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
def test_a_tie_at_the_top_k_edge_leaves_the_kernel_to_the_torch_ops():
    logits = torch.zeros(49152)
    logits[[5, 700, 9000]] = torch.tensor([4.0, 3.0, 3.0])
    assert sampling.fused_filters(logits, 1.0, 2, 1.0) is None
    probs = Sampler(GenerationSettings(temperature=1.0, top_k=2, top_p=1.0), CPU).distribution(
        logits, torch.tensor([], dtype=torch.long)
    )
    assert set(probs.nonzero().flatten().tolist()) == {5, 700, 9000}


def test_a_greedy_draw_names_no_distribution_and_picks_the_penalised_argmax():
    """Greedy writes no vocabulary-sized one-hot: `draw` gives None and the token that
    `distribution` puts all the probability on, the repetition penalty applied first."""
    generator = torch.Generator().manual_seed(12)
    history = torch.arange(0, 40_000, 97)
    settings = GenerationSettings(greedy=True, repetition_penalty=1.5)
    for _trial in range(20):
        logits = torch.randn(49152, generator=generator) * 3
        probs, chosen = Sampler(settings, CPU).draw(logits, history)
        assert probs is None
        one_hot = Sampler(settings, CPU).distribution(logits, history)
        assert one_hot.nonzero().flatten().tolist() == [int(chosen)]


def test_a_sampled_draw_is_its_distribution_and_choice():
    generator = torch.Generator().manual_seed(13)
    drawing, reference = (
        Sampler(GenerationSettings(seed=4), CPU),
        Sampler(GenerationSettings(seed=4), CPU),
    )
    for _trial in range(50):
        logits = torch.randn(49152, generator=generator) * 3
        probs, chosen = drawing.draw(logits, torch.tensor([], dtype=torch.long))
        want = reference.distribution(logits, torch.tensor([], dtype=torch.long))
        assert probs is not None and torch.equal(probs, want)
        assert int(chosen) == int(reference.choose(want))


def test_one_draw_is_torchs_multinomial_draw():
    """`draw_one` picks what torch.multinomial(weights, 1) picks from the same generator state,
    for few or many weights, zeros among them (a changed torch would fail here first)."""
    from engine.generate.sampling import draw_one

    source = torch.Generator().manual_seed(1)
    ours, torchs = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for trial in range(3000):
        size = (1, 2, 7, 50, 200)[trial % 5]
        weights = torch.rand(size, generator=source)
        weights[torch.rand(size, generator=source) < 0.3] = 0.0
        weights[trial % size] += 0.01  # never all zero
        weights /= weights.sum()
        want = int(torch.multinomial(weights, 1, generator=torchs)[0])
        assert int(draw_one(weights, ours)) == want


def test_a_distribution_of_no_numbers_is_refused_not_drawn_from():
    sampler = Sampler(GenerationSettings(seed=1), CPU)
    for bad in (torch.full((300,), float("nan")), torch.zeros(300)):
        with pytest.raises(ValueError, match="no token to draw"):
            sampler.choose(bad)
