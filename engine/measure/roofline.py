"""Count what one forward pass computes and moves, and place it on the machine's roofline.

For a pass over `new` positions after `cached` ones already in the KV cache:

    FLOPs  = 2 · (matmul weights) · new                  every block's projections and MLP
           + 2 · (head weights)                          the lm_head runs for the last position
           + Σ_layers 4 · heads · head_dim · pairs       q·kᵀ and weights·v over the real context
    pairs  = Σ_{t=cached+1}^{cached+new} min(t, window)  causal: row t sees t keys
    bytes  = weights as stored, read once per pass       (+ one embedding row per position)
           + KV read (every key and value attended)  + KV written (the new positions)

transformers' DynamicCache appends by concatenation, so each pass there also reads the old
cache and writes it back whole; Glassbox's own KVBuffer writes only the new positions.
Activations, norms' arithmetic and softmax are left out: they are small beside these terms.

Everything that depends only on the model is counted once (`ForwardCost.of`), so a step costs
a few integer operations on the hot path. `intensity` = FLOPs / bytes; a pass is
compute-bound when its intensity is right of the ridge point (peak FLOP/s / peak bytes/s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict, cast

import torch

from engine.events import Bound, ModelInfo, Peaks, Roofline

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.model.llama import GGUFLlama


class _Shape(TypedDict):
    """ForwardCost's fields that every kind of model fills from its ModelInfo."""

    layers: int
    heads: int
    head_dim: int
    windows: tuple[tuple[int | None, int], ...]
    kv_position_bytes: int


class _Weights(TypedDict):
    """ForwardCost's fields counted from the model's own weights."""

    matmul_params: int
    head_params: int
    weight_bytes: int
    row_bytes: int


@dataclass(frozen=True, slots=True)
class ForwardCost:
    """A model's per-pass constants, counted once at load."""

    layers: int
    heads: int
    head_dim: int
    matmul_params: int  # weights every new position multiplies (all blocks' projections)
    head_params: int  # weights the lm_head multiplies, once per pass (the last position)
    weight_bytes: int  # weights read in full by every pass, in their stored dtype
    row_bytes: int  # embedding bytes looked up per new position
    kv_position_bytes: int  # one position's keys + values in one layer
    # (window, layers with it); None: full attention. A step loops over these, not layers.
    windows: tuple[tuple[int | None, int], ...]
    concat_cache: bool  # the cache is rebuilt by concatenation every pass (DynamicCache)

    @classmethod
    def of(cls, model: torch.nn.Module, info: ModelInfo) -> ForwardCost:
        """The constants of `model`: Glassbox's GGUF model or a transformers causal LM."""
        shape = getattr(model, "shape", None)
        counts: dict[int | None, int] = {}
        for layer in range(info.layers):
            window = info.sliding_window if layer in info.sliding_layers else None
            counts[window] = counts.get(window, 0) + 1
        windows = tuple(counts.items())
        common = _Shape(
            layers=info.layers, heads=info.heads, head_dim=info.head_dim, windows=windows,
            kv_position_bytes=2 * info.kv_heads * info.head_dim * info.bytes_per_value,
        )  # fmt: skip
        # Told apart by duck type, so that counting a model never imports the other kind.
        if shape is not None and hasattr(model, "weight_bytes"):
            gguf = cast("GGUFLlama", model)
            return cls(**common, **_gguf_llama(gguf), concat_cache=False)
        causal_lm = cast("PreTrainedModel", model)
        return cls(**common, **_transformers(causal_lm), concat_cache=True)

    def flops(self, new: int, cached: int) -> int:
        per_pair = 4 * self.heads * self.head_dim  # q·kᵀ and weights·v: 2 FLOPs a MAC each
        attention = sum(
            layers * per_pair * _pairs(new, cached, window) for window, layers in self.windows
        )
        return 2 * self.matmul_params * new + 2 * self.head_params + attention

    def bytes(self, new: int, cached: int, with_cache: bool = True) -> int:
        weights = self.weight_bytes + self.row_bytes * new
        positions = 0  # keys+values of one layer read or written, summed over layers
        for window, layers in self.windows:
            kept = cached if window is None else min(cached, window)
            per_layer = kept + new  # attention reads the kept cache and the new positions
            if with_cache:
                per_layer += new  # the new positions are written into the cache
                if self.concat_cache:  # torch.cat reads the old cache and writes it again
                    per_layer += 2 * kept
            positions += layers * per_layer
        return weights + positions * self.kv_position_bytes


def _pairs(new: int, cached: int, window: int | None) -> int:
    """Query-key pairs of a causal pass: position t (1-based) sees min(t, window) keys."""
    first, last = cached + 1, cached + new
    if window is None or last <= window:
        return (first + last) * new // 2
    below = max(0, window - first + 1)  # rows still under the window: first..window
    summed = (first + window) * below // 2 if below else 0
    return summed + (new - below) * window


class Meter:
    """Rooflines of a model's passes against the machine's peaks (None: bound unknown)."""

    def __init__(self, cost: ForwardCost, peaks: Peaks | None) -> None:
        self.cost = cost
        self.ridge = peaks.ridge if peaks is not None else None

    def measure(self, new: int, cached: int, seconds: float, with_cache: bool = True) -> Roofline:
        flops = self.cost.flops(new, cached)
        moved = self.cost.bytes(new, cached, with_cache)
        return roofline(flops, moved, seconds, self.ridge)


def roofline(flops: int, moved: int, seconds: float, ridge: float | None) -> Roofline:
    """The pass's point: intensity and achieved rates from its measured `seconds`."""
    intensity = flops / moved if moved else 0.0
    rate = 1.0 / seconds if seconds > 0 else 0.0
    bound: Bound = "compute" if ridge is not None and intensity >= ridge else "memory"
    return Roofline(
        flops=flops, bytes=moved, intensity=intensity,
        flops_per_s=flops * rate, bytes_per_s=moved * rate, bound=bound,
    )  # fmt: skip


# -- per model kind ---------------------------------------------------------------------------


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _gguf_llama(model: GGUFLlama) -> _Weights:
    """engine.model.llama.GGUFLlama: packed 4/8-bit weights (with their scales) as the kernels read
    them; the embedding and the head's exact candidates are looked up row by row."""
    s = model.shape
    q_out, kv_out = s.heads * s.head_dim, s.kv_heads * s.head_dim
    per_layer = s.dim * (q_out + 2 * kv_out) + q_out * s.dim + 3 * s.dim * s.ffn
    head = model.output
    head_row = head.rows.shape[1] * head.rows.element_size()
    return _Weights(
        matmul_params=s.layers * per_layer,
        head_params=s.vocab * s.dim + head.candidates * s.dim,
        weight_bytes=model.weight_bytes() + head.candidates * head_row,
        row_bytes=model.embedding.rows.shape[1] * model.embedding.rows.element_size(),
    )


def _transformers(model: PreTrainedModel) -> _Weights:
    """A transformers causal LM: every 2-D projection (Linear, GPT-2's Conv1D) multiplies each
    position; embeddings are looked up per position; a tied head reads the embedding whole."""
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated upstream
    embeddings = [m for m in model.modules() if isinstance(m, torch.nn.Embedding)]
    embedding_ids = {id(m.weight) for m in embeddings}
    matmul = sum(
        _weight(m).numel()
        for m in model.modules()
        if m is not head and _is_projection(m) and id(m.weight) not in embedding_ids
    )
    looked_up = sum(m.weight.shape[1] * m.weight.element_size() for m in embeddings)
    read_whole = sum(_nbytes(p) for p in model.parameters() if id(p) not in embedding_ids)
    if head is not None and id(head.weight) in embedding_ids:  # tied: the head reads it all
        read_whole += _nbytes(_weight(head))
    return _Weights(
        matmul_params=matmul,
        head_params=_weight(head).numel() if head is not None else 0,
        weight_bytes=read_whole,
        row_bytes=looked_up,
    )


def _weight(module: torch.nn.Module) -> torch.Tensor:
    """A layer's weight: nn.Module's attribute lookup is typed as "a tensor or a module"."""
    return cast(torch.Tensor, module.weight)


def _is_projection(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"
