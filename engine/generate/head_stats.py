"""Per-head statistics of attention rows, where the model runs (see events.HeadStatistics).

The window's overview plots each head's mean largest weight and mean normalised entropy over
every row. Worked out here, on the rows' own device, they cross as [2, heads] per token instead
of the rows themselves ([heads, keys] per layer, growing with the context).
"""

from __future__ import annotations

import math

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
    in one copy to the host for all layers."""
    if not rows:
        return {}
    layers = sorted(rows)
    stacked = torch.stack([_one_row(rows[layer]) for layer in layers])  # [layers, 2, heads]
    host = stacked.cpu().numpy()
    return {layer: frozen_array(host[i]) for i, layer in enumerate(layers)}


def prefill_statistics(blocks: dict[int, torch.Tensor]) -> HeadStatistics:
    """layer -> [2, heads, queries] of a prompt's last rows ([heads, queries, keys] each)."""
    out: HeadStatistics = {}
    for layer, block in sorted(blocks.items()):
        queries, keys = block.shape[1], block.shape[2]
        positions = torch.arange(keys - queries, keys, device=block.device)
        out[layer] = frozen_array(row_statistics(block, positions).cpu().numpy())
    return out


def _one_row(row: torch.Tensor) -> torch.Tensor:
    keys = row.shape[-1]
    weights = row.float()
    largest = weights.amax(dim=-1)
    entropy = -(weights * weights.clamp_min(TINY).log()).sum(dim=-1)
    return torch.stack([largest, entropy / math.log(max(keys, 2))])
