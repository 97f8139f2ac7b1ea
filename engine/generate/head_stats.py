"""Per-head statistics of attention rows, where the model runs (see events.HeadStatistics).

The window's overview plots each head's mean largest weight and mean normalised entropy over
every row. Worked out here, on the rows' own device, they cross as [2, heads] per token instead
of the rows themselves ([heads, keys] per layer, growing with the context).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from engine.events import HeadStatistics, frozen_array
from engine.weights import ggml_kernel

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


def batch_statistics(steps: list[dict[int, torch.Tensor]]) -> list[HeadStatistics]:
    """Per step, layer -> [2, heads] of its decode rows (layer -> [heads, keys] each, its query
    the last key; a sliding-window layer's row shorter): a layer's rows of every step padded
    with zeros into one block (a zero adds nothing to either statistic), one batch of ops per
    layer and one copy to the host."""
    out: list[HeadStatistics] = [{} for _ in steps]
    for layer in sorted({layer for rows in steps for layer in rows}):
        which = [i for i, rows in enumerate(steps) if layer in rows]
        host = _layer_statistics([steps[i][layer] for i in which])
        for row, i in enumerate(which):
            out[i][layer] = frozen_array(host[row])
    return out


def _layer_statistics(rows: list[torch.Tensor]) -> np.ndarray:
    """[n, 2, heads] on the host for rows [heads, keys] of one layer: on the CPU, where the
    GGML kernels load, one C++ call (each small torch op below costs tens of microseconds
    between two decode steps); else the rows padded into one block."""
    on_cpu = all(row.device.type == "cpu" and row.dtype == torch.float32 for row in rows)
    if on_cpu and ggml_kernel.ensure() is None:
        statistics: torch.Tensor = torch.ops.glassbox.head_statistics(rows)
        return statistics.numpy()
    block = pad_sequence([row.float().T for row in rows], batch_first=True)  # [n, keys, heads]
    lengths = [max(row.shape[-1], 2) for row in rows]
    most = torch.tensor(lengths, dtype=torch.float32, device=block.device).log_()[:, None]
    entropy = torch.special.entr(block).sum(dim=1) / most  # [n, heads]
    return torch.stack([block.amax(dim=1), entropy], dim=1).cpu().numpy()


def prefill_statistics(blocks: dict[int, torch.Tensor]) -> HeadStatistics:
    """layer -> [2, heads, queries] of a prompt's last rows ([heads, queries, keys] each)."""
    out: HeadStatistics = {}
    for layer, block in sorted(blocks.items()):
        queries, keys = block.shape[1], block.shape[2]
        positions = torch.arange(keys - queries, keys, device=block.device)
        out[layer] = frozen_array(row_statistics(block, positions).cpu().numpy())
    return out
