"""One small interface for the two kinds of model a session can run.

    decoder.new_cache() -> cache with layer_bytes() and truncate(tokens)
    decoder.forward(ids [1, n], cache | None, probe | None) -> logits [vocab] float32

Glassbox's own GGUF model (engine/llama.py) has this shape already; a transformers model is
wrapped by `TransformersDecoder`, with its DynamicCache behind `TransformersCache`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, cast

import torch

from engine import kv_cache
from engine.attention_probe import PROBE_KWARG, AttentionProbe

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel


class Cache(Protocol):
    def layer_bytes(self) -> tuple[int, ...]: ...

    def truncate(self, tokens: int) -> bool: ...


class Decoder(Protocol):
    @property
    def device(self) -> torch.device: ...

    def new_cache(self) -> Cache: ...

    def forward(
        self, ids: torch.Tensor, cache: Cache | None, probe: AttentionProbe | None
    ) -> torch.Tensor: ...


class TransformersCache:
    """A transformers DynamicCache (it concatenates per step; the exact reference path)."""

    def __init__(self, inner: DynamicCache) -> None:
        self.inner = inner

    def layer_bytes(self) -> tuple[int, ...]:
        return kv_cache.layer_bytes(self.inner)

    def truncate(self, tokens: int) -> bool:
        return kv_cache.truncate(self.inner, tokens)


class TransformersDecoder:
    """A transformers causal LM behind the Decoder interface (attention through the probe)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = next(model.parameters()).device

    def new_cache(self) -> TransformersCache:
        from transformers import DynamicCache

        return TransformersCache(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: Cache | None, probe: AttentionProbe | None
    ) -> torch.Tensor:
        """One pass over `ids` [1, n] (the prompt, or one new token); the last position's logits."""
        extra = {PROBE_KWARG: probe} if probe is not None else {}
        # The cache is one this decoder's new_cache made: a session never mixes decoders.
        inner = cast(TransformersCache, cache).inner if cache is not None else None
        out = self.model(input_ids=ids, past_key_values=inner, use_cache=cache is not None,
                         logits_to_keep=1, **extra)  # fmt: skip
        logits: torch.Tensor = out.logits[0, -1]
        return logits.float()


def decoder_for(model: torch.nn.Module) -> Decoder:
    """The model itself if it is Glassbox's own, else a wrapper around the transformers model."""
    if hasattr(model, "new_cache"):
        return model  # type: ignore[return-value]
    return TransformersDecoder(cast("PreTrainedModel", model))
