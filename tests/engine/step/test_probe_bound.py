"""The probe bound (probe_bound.py) holds for what two correct steps may differ by, and fails
for what a wrong one computes."""

from __future__ import annotations

import pytest
import torch

from engine.model.attention_probe import attention_weights
from tests.engine.step.probe_bound import gamma, probe_bound, probe_f64

HEADS, KV_HEADS, D, KEYS = 8, 2, 64, 300
SCALE = D**-0.5


def rounded_apart(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 rounded to bf16 twice: to nearest, and the other way (one rounding apart)."""
    near = x.to(torch.bfloat16)
    down = torch.nextafter(near, torch.tensor(-torch.inf, dtype=torch.bfloat16))
    up = torch.nextafter(near, torch.tensor(torch.inf, dtype=torch.bfloat16))
    other = torch.where(near.float() > x, down, up)
    return near, other


def case(seed: int, spread: float = 1.0):
    """q and k one rounding apart; `spread` sets the logits' size (1: Σ|q·k|·scale ≈ 5)."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, 1, D, generator=generator) * spread
    k = torch.randn(1, KV_HEADS, KEYS, D, generator=generator) * spread
    return rounded_apart(q), rounded_apart(k)


def excess(probe: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> float:
    """How far past the bound `probe` lies from the float64 probe of q, k (<= 0: within)."""
    referee, bound = probe_f64(q, k, SCALE, KEYS), probe_bound(q, k, SCALE, KEYS)
    return float(((probe.double() - referee).abs() - bound).max())


@pytest.mark.parametrize(("seed", "spread"), [(0, 1.0), (1, 0.3), (2, 3.0), (3, 1.0)])
def test_a_step_whose_q_and_k_are_one_rounding_apart_stays_within(seed, spread):
    (q, q_other), (k, k_other) = case(seed, spread)
    assert not torch.equal(q, q_other) and not torch.equal(k, k_other)
    probe = attention_weights(q_other, k_other, None, SCALE, 1)  # float32, as the steps compute
    assert excess(probe, q, k) <= 0
    assert excess(attention_weights(q, k, None, SCALE, 1), q, k) <= 0


def test_the_bound_follows_the_dtypes():
    """bf16 storage allows ~2^10 times what float32 storage does (the worst case, every
    rounding the same way: it grows with Σ|q·k|, ~13% of a weight at this case's logits)."""
    (q, _), (k, _) = case(0)
    weight = probe_f64(q, k, SCALE, KEYS)
    bf16 = probe_bound(q, k, SCALE, KEYS) / weight
    f32 = probe_bound(q.float(), k.float(), SCALE, KEYS, storage=torch.float32) / weight
    assert 0.01 < bf16.max() < 0.2 and f32.max() < bf16.max() * 2**-10
    assert excess(attention_weights(q.float(), k.float(), None, SCALE, 1), q, k) <= 0


@pytest.mark.parametrize(
    "wrong",
    [
        lambda q, k: attention_weights(q, k, None, SCALE * 1.05, 1),  # a scale 5% off
        lambda q, k: attention_weights(q.roll(1, dims=1), k, None, SCALE, 1),  # heads swapped
        lambda q, k: attention_weights(q * (1 + 2**-5), k, None, SCALE, 1),  # q 4 roundings off
    ],
)
def test_a_wrong_probe_falls_outside(wrong):
    (q, _), (k, _) = case(1)
    assert excess(wrong(q, k), q, k) > 0


def test_gamma_refuses_a_reduction_too_long_for_its_precision():
    assert gamma(64, 2**-24) == pytest.approx(64 * 2**-24, rel=1e-5)
    with pytest.raises(AssertionError):
        gamma(300, 2**-8)
