"""Capture attention weights without giving up SDPA.

`glassbox_attention` is registered through transformers' `AttentionInterface` (with the SDPA
mask builder through `AttentionMaskInterface`). It always computes the layer's output with
SDPA; for the layers an `AttentionProbe` watches it also computes softmax(q·kᵀ·scale + mask)
for the last `rows` query rows, the only weights the view needs. `output_attentions=True` would
instead force eager attention on every layer and materialise every matrix.

transformers is imported only when a transformers model registers the probe: Glassbox's own
GGUF model (engine/model/llama.py) uses `attention_weights` without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.model.prompt_attention import in_float32_here
from engine.weights import ggml_kernel

ATTN_IMPLEMENTATION = "glassbox"
PROBE_KWARG = "glassbox_probe"


@dataclass
class AttentionProbe:
    """Which layers to watch in one forward pass, and what they attended to."""

    layers: frozenset[int]
    rows: int = 1  # how many of the last query rows to keep
    weights: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [heads, rows, keys]
    # Not None: a one-token pass of Glassbox's own model may leave its watched layers' queries
    # here (layer -> [1, heads, 1, d]) instead of weighing them now; the session's batch of
    # steps weighs several steps' at once (engine/generate/view_batch.py)
    queries: dict[int, torch.Tensor] | None = None

    def wants(self, layer: int | None) -> bool:
        return layer is not None and layer in self.layers


def attention_weights(
    query: torch.Tensor,  # [1, heads, q, head_dim]
    key: torch.Tensor,  # [1, kv_heads, k, head_dim]
    mask: torch.Tensor | None,  # [1, 1, q, k] bool (True = attend) or additive float; None = causal
    scaling: float,
    rows: int,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + mask) for the last `rows` queries: [heads, rows, keys], float32."""
    kv_heads, k_len, head_dim = key.shape[1], key.shape[2], key.shape[3]
    heads, q_len = query.shape[1], query.shape[2]
    rows = min(rows, q_len)
    if mask is None and _one_call(query, key, rows):
        # a decode batch's few rows on the CPU: one C++ call, where the ops below are ten,
        # each tens of microseconds between two decode steps, and widen every key to float32
        weights: torch.Tensor = torch.ops.glassbox.causal_rows(query, key, scaling, rows)
        return weights
    # Each key head serves `heads // kv_heads` query heads in a row: one batched product per
    # key head, its query heads' rows stacked, instead of copying the keys once per query head
    # (at 1,000 keys that copy, and a broadcast matmul, were most of a decode step's probe).
    q = query[0, :, q_len - rows :].float().reshape(kv_heads, -1, head_dim)
    k = key[0].float()  # [kv_heads, keys, head_dim]
    scores = torch.bmm(q, k.transpose(1, 2)).reshape(heads, rows, k_len) * scaling
    if mask is None:
        # SDPA skipped the mask because it is purely causal: queries are the last q_len
        # positions, so the very last one (a decode step's) sees every key.
        if rows > 1:
            query_pos = torch.arange(k_len - rows, k_len, device=scores.device)[:, None]
            allowed = torch.arange(k_len, device=scores.device)[None, :] <= query_pos
            scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        mask = mask[0, 0, q_len - rows :, -k_len:]
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask.float()
    return torch.softmax(scores, dim=-1)


def glassbox_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    probe: AttentionProbe | None = kwargs.pop(PROBE_KWARG, None)
    q, k, v, mask = query, key, value, attention_mask
    if in_float32_here(query):  # torch's bf16 kernel does not run on this CPU
        q, k, v = query.float(), key.float(), value.float()
        if mask is not None and mask.is_floating_point():
            mask = mask.float()
    output, _ = sdpa_attention_forward(module, q, k, v, mask, **kwargs)
    output = output.to(query.dtype)
    layer = getattr(module, "layer_idx", None)
    if probe is not None and layer is not None and probe.wants(layer) and query.shape[0] == 1:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        probe.weights[layer] = attention_weights(query, key, attention_mask, scaling, probe.rows)
    return output, None


def register() -> str:
    """Register the probe (idempotent); returns the name to pass as attn_implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, glassbox_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
    return ATTN_IMPLEMENTATION


BATCH_ROWS = 32  # the most rows the C++ op weighs (a decode batch's; a prompt's go to torch)


def _one_call(query: torch.Tensor, key: torch.Tensor, rows: int) -> bool:
    """Whether the GGML kernels' causal_rows can weigh these rows (see attention_weights)."""
    cpu = query.device.type == "cpu" and key.device.type == "cpu"
    fits = rows <= BATCH_ROWS and query.shape[-1] % 8 == 0 and rows <= key.shape[2]
    floats = key.dtype in (torch.bfloat16, torch.float32) and query.dtype.is_floating_point
    return cpu and fits and floats and ggml_kernel.ensure() is None
