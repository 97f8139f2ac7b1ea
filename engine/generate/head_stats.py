"""Per-head statistics of attention rows, where the model runs (see events.HeadStatistics).

The window's overview plots each head's mean largest weight and mean normalised entropy over
every row. Worked out here, on the rows' own device, they cross as [2, heads] per token instead
of the rows themselves ([heads, keys] per layer, growing with the context).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from engine.events import HeadStatistics, frozen_array

TINY = torch.finfo(torch.float32).tiny


def row_statistics(rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[2, heads, n]: max weight and normalised entropy of [heads, n, keys] rows whose queries
    sit at context `positions` [n]. Keys past a query (the causal mask's zeros) add nothing:
    0 · log(tiny) is 0."""
    weights = rows.float()
    largest = weights.amax(dim=-1)
    entropy = -(weights * weights.clamp_min(TINY).log()).sum(dim=-1)
    most = torch.clamp(positions + 1, min=2).to(weights.dtype).log()
    return torch.stack([largest, entropy / most])


def decode_statistics(rows: dict[int, torch.Tensor]) -> HeadStatistics:
    """layer -> [2, heads] of one decode row per layer ([heads, keys], its query the last key),
    the layers of one length in one batch of operations and one copy to the host (a handful of
    ops a token, whatever the number of watched layers; a sliding-window layer's rows are
    shorter, a batch of their own)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for layer in sorted(rows):
        groups.setdefault(tuple(rows[layer].shape), []).append(layer)
    out: HeadStatistics = {}
    for layers in groups.values():
        weights = torch.stack([rows[layer] for layer in layers]).float()  # [layers, heads, keys]
        keys = weights.shape[-1]
        if weights.device.type == "cpu":
            host = _host_statistics(weights.numpy(), keys)
        else:
            host = _device_statistics(weights, keys)
        out.update({layer: frozen_array(host[i]) for i, layer in enumerate(layers)})
    return dict(sorted(out.items()))


def _device_statistics(weights: torch.Tensor, keys: int) -> np.ndarray:
    """[layers, 2, heads] of [layers, heads, keys] rows, on their device; one copy back."""
    largest = weights.amax(dim=-1)
    w_log_w = (weights * weights.clamp_min(TINY).log()).sum(dim=-1)
    stacked = torch.stack([largest, -w_log_w / math.log(max(keys, 2))], dim=1)
    host: np.ndarray = stacked.cpu().numpy()
    return host


def _host_statistics(weights: np.ndarray, keys: int) -> np.ndarray:
    """[layers, 2, heads] of [layers, heads, keys] rows in memory: numpy's logarithm is
    vectorised where torch's CPU one is several times slower, and a
    batched matmul sums w·log w in one pass."""
    logs = np.log(np.maximum(weights, TINY))
    w_log_w = (weights[..., None, :] @ logs[..., :, None])[..., 0, 0]  # [layers, heads]
    entropy = -w_log_w / math.log(max(keys, 2))
    return np.stack([weights.max(axis=-1), entropy], axis=1)


def prefill_statistics(blocks: dict[int, torch.Tensor]) -> HeadStatistics:
    """layer -> [2, heads, queries] of a prompt's last rows ([heads, queries, keys] each)."""
    out: HeadStatistics = {}
    for layer, block in sorted(blocks.items()):
        queries, keys = block.shape[1], block.shape[2]
        positions = torch.arange(keys - queries, keys, device=block.device)
        out[layer] = frozen_array(row_statistics(block, positions).cpu().numpy())
    return out
