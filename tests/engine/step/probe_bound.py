"""How far an attention probe may lie from its float64 value: a bound from the dtypes and the
reduction lengths, not a constant measured on one machine.

A probe is softmax(q·kᵀ·scale) over the keys, q and k stored in the cache's dtype (bf16) and
multiplied in float32. Two correct steps (eager, or a CUDA graph whose kernels round in another
order) may store q and k one rounding apart, and their float32 arithmetic rounds differently.
With u_in the storage dtype's unit roundoff, u the compute dtype's, d = head_dim and
γ_n(u) = n·u / (1 − n·u) (Higham's bound for a sum of n terms):

- a logit's error:  δ ≤ scale · (2·u_in + γ_d(u)) · Σ_t |q_t·k_t|   (q and k each one rounding
  off, then the dot product's own);
- softmax: p_j ∝ exp(s_j), so logits each off by at most δ_max move p_j by a factor within
  exp(±2·δ_max); its own float32 exp, sum over the n keys and division add γ_{n+3}(u):
  |p̂_j − p_j| ≤ p_j · expm1(2·δ_max + γ_{n+3}(u)).

The referee p is computed in float64 from one step's q and k (`probe_f64`); both steps' probes
are held to it.
"""

from __future__ import annotations

import torch


def gamma(n: int, u: float) -> float:
    """Higham's γ_n: the relative error bound of a sum of n products rounded at u."""
    assert n * u < 1, "the reduction is too long for this precision"
    return n * u / (1 - n * u)


def unit_roundoff(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps / 2


def grouped_keys(q: torch.Tensor, k: torch.Tensor, keys: int) -> torch.Tensor:
    """The last `keys` keys [heads, keys, d] in float64, each query head's own (GQA)."""
    k = k[0, :, -keys:].double()
    return k.repeat_interleave(q.shape[1] // k.shape[0], dim=0)


def probe_f64(q: torch.Tensor, k: torch.Tensor, scale: float, keys: int) -> torch.Tensor:
    """The last query's probe over the last `keys` keys, in float64: [heads, 1, keys]."""
    scores = q[0, :, -1:].double() @ grouped_keys(q, k, keys).transpose(1, 2) * scale
    return torch.softmax(scores, dim=-1)


def probe_bound(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    keys: int,
    storage: torch.dtype = torch.bfloat16,
    compute: torch.dtype = torch.float32,
) -> torch.Tensor:
    """|probe − probe_f64| allowed per element [heads, 1, keys] (see the module docstring)."""
    d = q.shape[-1]
    u_in, u = unit_roundoff(storage), unit_roundoff(compute)
    magnitude = q[0, :, -1:].double().abs() @ grouped_keys(q, k, keys).abs().transpose(1, 2)
    delta = scale * (2 * u_in + gamma(d, u)) * magnitude  # [heads, 1, keys]
    largest = delta.amax(dim=-1, keepdim=True)
    return probe_f64(q, k, scale, keys) * torch.expm1(2 * largest + gamma(keys + 3, u))
