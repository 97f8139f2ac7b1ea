"""One small interface for the two kinds of model a session can run.

    decoder.new_cache() -> cache with layer_bytes() and truncate(tokens)
    decoder.forward(ids [1, n], cache | None, probe | None) -> logits [vocab] float32

Glassbox's own GGUF model (engine/model/llama.py) has this shape already; a transformers model is
wrapped by `TransformersDecoder`, with its DynamicCache behind `TransformersCache`.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Protocol, cast

import torch

from engine import kv_formula
from engine.model.attention_probe import PROBE_KWARG, AttentionProbe

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
        return kv_formula.layer_bytes(self.inner)

    def truncate(self, tokens: int) -> bool:
        return kv_formula.truncate(self.inner, tokens)


class TransformersDecoder:
    """A transformers causal LM behind the Decoder interface (attention through the probe)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.device = execution_device(model)
        self.cache_kwarg = cache_kwarg(model)

    def new_cache(self) -> TransformersCache:
        from transformers import DynamicCache

        return TransformersCache(DynamicCache(config=self.model.config))

    @torch.inference_mode()
    def forward(
        self, ids: torch.Tensor, cache: Cache | None, probe: AttentionProbe | None
    ) -> torch.Tensor:
        """One pass over `ids` [1, n] (the prompt, or one new token); the last position's logits."""
        extra: dict[str, object] = {PROBE_KWARG: probe} if probe is not None else {}
        # The cache is one this decoder's new_cache made: a session never mixes decoders.
        inner = cast(TransformersCache, cache).inner if cache is not None else None
        extra[self.cache_kwarg] = inner
        out = self.model(input_ids=ids, use_cache=cache is not None, logits_to_keep=1, **extra)
        logits: torch.Tensor = out.logits[0, -1]
        return logits.float()


def cache_kwarg(model: torch.nn.Module) -> str:
    """The name of the forward argument that takes the KV cache: `cache` since transformers
    5.24, which deprecates `past_key_values` (a FutureWarning; removal announced for 5.40);
    `past_key_values` before (5.17-5.23 know no other). Read from the model's own signature,
    which the deprecation wrapper passes through, so each model class answers for itself."""
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def execution_device(model: torch.nn.Module) -> torch.device:
    """Where the model computes: its first weight's device, or for a model placed by
    accelerate (whose first weight may wait on disk, "meta") its hooks' execution device."""
    hook = getattr(model, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is not None:
        return torch.device(device)
    return next(model.parameters()).device


def decoder_for(model: torch.nn.Module) -> Decoder:
    """The model itself if it is Glassbox's own, else a wrapper around the transformers model."""
    if hasattr(model, "new_cache"):
        return model  # type: ignore[return-value]
    return TransformersDecoder(cast("PreTrainedModel", model))
