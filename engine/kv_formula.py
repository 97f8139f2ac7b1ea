"""Measure the KV cache from its tensors, and the formula it is checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.events import ModelInfo

if TYPE_CHECKING:  # the UI imports the formula; it need not load transformers for it
    import torch
    from transformers.cache_utils import Cache


def layer_bytes(cache: Cache | None) -> tuple[int, ...]:
    """Bytes held by each layer's keys and values, read from the tensors themselves."""
    if cache is None:
        return ()
    sizes = []
    for layer in cache.layers:
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        sizes.append(_nbytes(keys) + _nbytes(values))
    return tuple(sizes)


def truncate(cache: Cache, tokens: int) -> bool:
    """Keep the first `tokens` positions of every layer; False if a layer cannot rewind.

    Done on the tensors directly: `Cache.crop`'s argument changed meaning between
    transformers releases, and sliding-window layers have already dropped old positions.
    """
    layers = cache.layers
    if any(getattr(layer, "is_sliding", False) or not hasattr(layer, "keys") for layer in layers):
        return False
    for layer in layers:
        held: Any = layer  # a full-attention layer: it has keys and values (checked above)
        if held.keys is not None and held.keys.dim() == 4:
            held.keys = held.keys[..., :tokens, :]
            held.values = held.values[..., :tokens, :]
    return True


def _nbytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None or tensor.dim() == 0 else tensor.numel() * tensor.element_size()


def sliding_tokens(info: ModelInfo, tokens: int) -> int:
    """Tokens a sliding-window layer holds: the last window - 1 (the next query brings one)."""
    return min(tokens, (info.sliding_window or tokens + 1) - 1)


def cached_tokens_per_layer(info: ModelInfo, tokens: int) -> tuple[int, ...]:
    """How many tokens each layer keeps: all of them, or the window on sliding-window layers."""
    kept = sliding_tokens(info, tokens)
    return tuple(kept if layer in info.sliding_layers else tokens for layer in range(info.layers))


def formula_bytes(info: ModelInfo, tokens: int) -> int:
    """2 x layers x kv_heads x head_dim x tokens x bytes; sliding layers capped at their window."""
    per_token = 2 * info.kv_heads * info.head_dim * info.bytes_per_value
    return per_token * sum(cached_tokens_per_layer(info, tokens))


def mha_bytes(info: ModelInfo, tokens: int) -> int:
    """The same cache if every query head had its own KV head (no grouped-query attention)."""
    return formula_bytes(info, tokens) * info.heads // info.kv_heads
