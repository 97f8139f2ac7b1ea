"""The one decoder layer over flat tensors: what the CPU's compiled step traces.

torch.export sees tensors alone, so a model's layers reach engine/model/layer.py's
`decode_layer` here as a static plan per layer (`LayerPlan`: the kinds of its weights'
kernels, its form, which optional tensors it has, how it attends) and flat tensors
(`layer_weights`), with ops that run each kind of weight, write the cache at positions carried
as tensor sizes, and attend with the GGML kernel or loops inductor fuses (`decode_layers`).
engine/step/compiled.py exports, builds and loads it; the static step (engine/step/static.py)
shares `layers_refusal`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from engine.model.gemma import GemmaAttention, GemmaBlock, GemmaFeedForward
from engine.model.kv_buffer import KVBuffer, WindowedKVBuffer
from engine.model.layer import LayerForm, LayerOps, LayerWeights, decode_layer, rotate
from engine.model.llama import Attention, Block, FeedForward, GGUFLlama, QKNormAttention
from engine.weights import ggml_kernel
from engine.weights.linear import (
    BLOCK,
    DenseLinear,
    GGMLLinear,
    Int4Linear,
    PartsLinear,
    Q6KLinear,
    interleave_q6,
)

if TYPE_CHECKING:
    from engine.weights.linear import Linear, Part

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default

# One layer's tensors in the step: LayerWeights' that it has, then its linears' parts'
LayerTensors = tuple[torch.Tensor, ...]


def layers_refusal(model: GGUFLlama, step: str) -> str | None:
    """Why a fast step (`step` names it) cannot run this model's layers: one whose block,
    attention or feed-forward is a class layer.decode_layer was not written for."""
    for block in _blocks(model):
        if type(block) not in BLOCKS:
            return f"its {type(block).__name__} layers are not in the {step}"
        for part in (block.attention, block.feed_forward):
            if type(part) not in PARTS:
                return f"its {type(part).__name__} is not in the {step}"
    return None


# The classes whose layers layer.decode_layer runs, every field of theirs in LayerWeights,
# LayerForm or a step's ops: a subclass may add what none of them has.
BLOCKS = (Block, GemmaBlock)
PARTS = (Attention, QKNormAttention, GemmaAttention, FeedForward, GemmaFeedForward)


def kinds_refusal(model: GGUFLlama) -> str | None:
    """Why the compiled step has no kernel for one of this model's weights, or None."""
    for block in _blocks(model):
        for linear in block.linears():
            if any(_kind(part) is None for part in _parts(linear)):
                return f"its {type(linear).__name__} weights are not in the compiled step"
    return None


def _blocks(model: GGUFLlama) -> list[Block]:
    return cast("list[Block]", list(model.blocks))


# How one product of a layer runs in the compiled step, and how many tensors it takes; a
# GGML kernel's kind names its type ("ggml 12"), and takes the raw blocks alone.
INT4, INT4_HALVES, INT4_Q6, BF16, GGML = "int4", "int4 halves", "int4 per 16", "bf16", "ggml"
TENSORS = {INT4: 2, INT4_HALVES: 2, INT4_Q6: 2, BF16: 1}


@dataclass(frozen=True)
class LayerPlan:
    """The static shape of one layer in the step: its form, which of LayerWeights' tensors it
    has (in their order), for qkv, out, gate_up and down the kind of each of their parts (a
    part per layout), and how it attends."""

    linears: tuple[tuple[str, ...], ...]
    form: LayerForm
    weights: tuple[str, ...] = ("attention_norm", "ffn_norm")
    attention_kernel: bool = False  # the GGML kernels' attend_one, not inductor's loops
    rope: int = 0  # which of the pass's rotations (Block.rope)
    window: int = 0  # keys a query sees on a sliding layer; 0: every key
    scale: float | None = None  # q·k scale; None: head_dim ** -0.5

    @property
    def bias(self) -> bool:  # Qwen2's q/k/v biases
        return "bias" in self.weights

    @property
    def qk_norm(self) -> bool:  # Qwen3's and Gemma 3's
        return "qk_norm" in self.weights


def _parts(linear: Linear) -> list[Part]:
    return linear.linears() if isinstance(linear, PartsLinear) else [linear]


def _kind(part: Part) -> str | None:
    if isinstance(part, GGMLLinear):
        return f"{GGML} {part.qtype}"
    if isinstance(part, Int4Linear):
        return INT4 if part.plain else INT4_HALVES
    if isinstance(part, Q6KLinear):
        return INT4_Q6
    if isinstance(part, DenseLinear) and part.weight.dtype == torch.bfloat16:
        return BF16
    return None


def _tensors(part: Part) -> tuple[torch.Tensor, ...]:
    if isinstance(part, GGMLLinear):
        return (part.raw,)
    if isinstance(part, Int4Linear | Q6KLinear):
        return part.packed, part.scales_zeros
    assert isinstance(part, DenseLinear)  # refusal() allowed no other kind
    return (part.weight,)


def layer_plan(model: GGUFLlama) -> tuple[LayerPlan, ...]:
    """Each layer's plan (refusal() has checked that every part has a kind)."""
    return tuple(
        LayerPlan(
            linears=tuple(
                tuple(cast("str", _kind(part)) for part in _parts(linear))
                for linear in block.linears()
            ),
            form=block.form,
            weights=tuple(name for name, t in block.weights()._asdict().items() if t is not None),
            attention_kernel=ggml_kernel.in_use(),
            rope=block.rope,
            window=block.attention.window or 0,
            scale=block.attention.scale,
        )
        for block in _blocks(model)
    )


def layer_weights(model: GGUFLlama) -> list[LayerTensors]:
    """Per layer: LayerWeights' tensors that it has, then each part's tensors (plan order)."""
    weights = []
    for block in _blocks(model):
        held = tuple(t for t in block.weights() if t is not None)
        tensors = [t for linear in block.linears() for p in _parts(linear) for t in _tensors(p)]
        weights.append((*held, *tensors))
    return weights


def decode_layers(
    x: torch.Tensor,
    ropes: Sequence[Sequence[torch.Tensor]],
    positions: Sequence[torch.Tensor],
    eps: torch.Tensor,
    weights: Sequence[LayerTensors],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    plan: Sequence[LayerPlan],
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """Every layer of a one-token pass: layer.decode_layer with the step's ops over flat tensors.

    x [1, dim] float32; ropes: per RoPE base, what layer.rotate takes (llama.Rope.tensors);
    positions: tensors [P, 0] whose lengths are sizes, so that each is one dynamic size and not
    a constant of the graph (`step_positions`); eps [1, 1]; weights per layer as layer_weights
    gives them; keys/values [1, kv_heads, capacity, d] per layer. Returns x after the last
    layer, each layer's queries [1, heads, 1, d] and each layer's output [layers, dim] float32
    (the residual stream a logit lens reads; the last row is the returned x).
    """
    queries, outputs = [], []
    for layer, tensors in enumerate(weights):
        p = plan[layer]
        held = len(p.weights)
        slot, first = _slots(positions, p.window)
        ops = LayerOps(
            multiply=functools.partial(_multiply, p.linears, _per_linear(p, tensors[held:])),
            rotate=functools.partial(rotate, rope=ropes[p.rope]),
            write=functools.partial(_write, keys[layer], values[layer], slot, first),
            attend=functools.partial(_attend, p),
        )
        named = LayerWeights(**dict(zip(p.weights, tensors[:held], strict=True)))
        x, q = decode_layer(x, named, p.form, eps, ops)
        queries.append(q)
        outputs.append(x)
    return x, queries, torch.cat(outputs)


def step_positions(start: int, cache: KVBuffer, window: int) -> tuple[torch.Tensor, ...]:
    """decode_layers' positions for the token at `start`: [start + 1, 0] (the keys after it is
    written); with sliding layers also the slot it is written to there [slot + 1, 0] (a
    WindowedKVBuffer's sliding layers start at its offset) and the first slot their query
    sees [first + 2, 0] (+ 2: a size of 0 or 1 would be taken for a constant)."""
    filled = torch.empty(start + 1, 0)
    if not window:
        return (filled,)
    slot = start - (cache.offset if isinstance(cache, WindowedKVBuffer) else 0)
    first = max(0, slot - (window - 1))
    return filled, torch.empty(slot + 1, 0), torch.empty(first + 2, 0)


def _slots(positions: Sequence[torch.Tensor], window: int) -> tuple[int, int]:
    """(the cache slot the new key goes to, the first slot its query sees) on a layer."""
    if not window:
        return positions[0].shape[0] - 1, 0
    return positions[1].shape[0] - 1, positions[2].shape[0] - 2


def _write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: int,
    first: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new key and value into their slot; the slots the query sees."""
    k_cache[:, :, slot : slot + 1] = k
    v_cache[:, :, slot : slot + 1] = v
    return k_cache[:, :, first : slot + 1], v_cache[:, :, first : slot + 1]


def _attend(plan: LayerPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, h, 1, d] over k, v [1, kv_h, T, d]: the GGML kernel or inductor's loops."""
    heads, kv_heads, d = plan.form.heads, plan.form.kv_heads, plan.form.head_dim
    grouped = q.view(kv_heads, heads // kv_heads, d)  # the query heads of a key head together
    scale = d**-0.5 if plan.scale is None else plan.scale
    if plan.attention_kernel:  # it scales by d ** -0.5: another scale goes into q first
        if scale != d**-0.5:
            grouped = grouped.float() * (scale * d**0.5)
        y: torch.Tensor = torch.ops.glassbox.attend_one(grouped, k[0], v[0])
    else:
        y = _attend_one(grouped, k[0], v[0], scale)
    return y.view(1, heads, 1, d)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head over the cache, as products and sums inductor fuses into loops that
    read the bf16 keys and values as they are (SDPA on float32 copies read them three times,
    and the copies outgrow the CPU's caches at long contexts, where the eager step is much
    slower than this one). q [kv_h, g, d] (the g query heads of a
    key head), k and v [kv_h, T, d] -> [kv_h, g, d] float32."""
    scores = (q.float()[:, :, None, :] * k.float()[:, None]).sum(-1).mul(scale)
    weights = scores.softmax(-1)  # [kv_h, g, T]
    return (weights[..., None] * v.float()[:, None]).sum(-2)


def _per_linear(plan: LayerPlan, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors of qkv, out, gate_up and down, each linear's in a list of its own."""
    out, at = [], 0
    for kinds in plan.linears:
        count = sum(1 if kind.startswith(GGML) else TENSORS[kind] for kind in kinds)
        out.append(list(tensors[at : at + count]))
        at += count
    return out


def _multiply(
    kinds: Sequence[Sequence[str]],
    tensors: Sequence[list[torch.Tensor]],
    which: int,
    x: torch.Tensor,
) -> torch.Tensor:
    """LayerOps.multiply over the plan's kinds: linear `which` (layer.QKV..DOWN)."""
    return _linear(kinds[which], x, list(tensors[which]))


def _linear(kinds: Sequence[str], x: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """x [1, in] bf16 through the parts of one linear, taking their tensors off the front of
    `tensors`; the parts' outputs concatenated (q/k/v of two layouts: two products)."""
    outputs = []
    for kind in kinds:
        name, _, qtype = kind.partition(" ")
        if name == GGML:  # the raw blocks alone, their type in the kind
            outputs.append(torch.ops.glassbox.ggml_mm(x, tensors.pop(0), int(qtype)))
            continue
        taken = [tensors.pop(0) for _ in range(TENSORS[kind])]
        if kind == BF16:
            outputs.append(F.linear(x, taken[0]))
            continue
        y = _int4_mm(interleave_q6(x) if kind == INT4_Q6 else x, taken[0], BLOCK, taken[1])
        if kind == INT4_HALVES:  # [hi rows; lo rows]: their sum is the weight's product
            y = y[:, : y.shape[1] // 2] + y[:, y.shape[1] // 2 :]
        outputs.append(y)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


def window_of(plan: Sequence[LayerPlan]) -> int:
    """The sliding layers' window (0: none slides)."""
    return max((p.window for p in plan), default=0)
