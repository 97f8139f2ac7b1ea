"""One decoder layer's one-token step, written once for every step that runs it.

`decode_layer` is the layer of every architecture the fast model reads (Llama, SmolLM, Qwen2's
biases, Qwen3's QK-norm, Gemma 3's norms, GeGLU and sliding window) for one new position.
The eager forward (engine/model/llama.py), the CPU's AOTInductor step (engine/step/compiled.py)
and the GPU's CUDA graph step (engine/step/static.py) all call it; what differs between them
is passed in as `LayerOps`:

- multiply: how a linear runs (the GGUF modules, the compiled step's kernels over flat
  tensors, bf16 on a GPU);
- rotate: RoPE for this layer's base (a matrix or cos/sin tables);
- write: where the new key and value go, returning the keys and values the query sees (a
  growing KVBuffer, a sliding window, a whole bucket);
- attend: attention of the query over them (SDPA, inductor's loops, the GGML kernel, a
  masked bucket).

It is a plain function over tensors and frozen, hashable descriptions, so torch.export and
torch.compile trace it: an optional weight is None and skipped at trace time. The prompt's
pass (n > 1) keeps its own attention (masks, probes of whole matrices) but calls the same
pieces: `qk_norm`, `rotate`, `glu`, and llama.py's norms, which take `norm_row` and
`post_norm_row` for one position.

Shapes: x [1, dim] float32 (the residual stream); activations into a linear are bf16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

QKV, OUT, GATE_UP, DOWN = range(4)  # the layer's linears, in the order they run


@dataclass(frozen=True)
class LayerForm:
    """The static shape of a layer: heads, and which activation its feed-forward gates with."""

    heads: int
    kv_heads: int
    head_dim: int
    gelu: bool = False  # GeGLU (gelu, tanh approximation; Gemma) instead of SwiGLU


class LayerWeights(NamedTuple):
    """A layer's tensors besides its linears; None where the architecture has none."""

    attention_norm: torch.Tensor  # [dim] float32
    ffn_norm: torch.Tensor  # [dim] float32
    bias: torch.Tensor | None = None  # q/k/v biases [(h + 2·kv_h)·d] bf16 (Qwen2)
    qk_norm: torch.Tensor | None = None  # [h + kv_h, d] float32 (Qwen3, Gemma 3)
    post_attention_norm: torch.Tensor | None = None  # [dim] float32 (Gemma 3)
    post_ffn_norm: torch.Tensor | None = None  # [dim] float32 (Gemma 3)


Multiply = Callable[[int, torch.Tensor], torch.Tensor]  # (QKV..DOWN, x [1, in] bf16) -> [1, out]
Rotate = Callable[[torch.Tensor], torch.Tensor]  # [1, h + kv_h, d] -> rotated, bf16
# (k, v [1, kv_h, 1, d] bf16) -> the keys and values the query sees [1, kv_h, T, d]
Write = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (q [1, h, 1, d] bf16, keys, values) -> [1, h, 1, d] (any float dtype)
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class LayerOps(NamedTuple):
    """How one step multiplies, rotates, writes the cache and attends, for one layer."""

    multiply: Multiply
    rotate: Rotate
    write: Write
    attend: Attend


def decode_layer(
    x: torch.Tensor, weights: LayerWeights, form: LayerForm, eps: torch.Tensor, ops: LayerOps
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new position through one layer: x [1, dim] float32 -> (x after the layer, the
    layer's query [1, h, 1, d] bf16, which the probes weigh against the cached keys).
    eps: [1, 1] float32 (a tensor, so a traced step takes it as an input)."""
    heads, kv_heads, d = form.heads, form.kv_heads, form.head_dim
    qk_heads = heads + kv_heads
    qkv = ops.multiply(QKV, norm_row(x, weights.attention_norm, eps))  # [1, (h + 2·kv_h)·d]
    if weights.bias is not None:
        qkv = qkv + weights.bias
    qk = qkv[:, : qk_heads * d].view(1, qk_heads, d)
    if weights.qk_norm is not None:
        qk = qk_norm(qk, weights.qk_norm, eps)
    qk = ops.rotate(qk).view(1, qk_heads, 1, d)  # one position: a plain view
    q, k = qk[:, :heads], qk[:, heads:]  # [1, h, 1, d], [1, kv_h, 1, d]
    v = qkv[:, qk_heads * d :].view(1, kv_heads, 1, d)
    keys, values = ops.write(k, v)
    y = ops.attend(q, keys, values)
    h = ops.multiply(OUT, y.to(torch.bfloat16).reshape(1, heads * d))
    x = x + post_norm_row(h, weights.post_attention_norm, eps)
    gate_up = ops.multiply(GATE_UP, norm_row(x, weights.ffn_norm, eps))
    h = ops.multiply(DOWN, glu(gate_up, form.gelu))
    return x + post_norm_row(h, weights.post_ffn_norm, eps), q


def norm_row(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """float32 [1, dim] -> RMS-normalised and scaled in float32, out in bf16."""
    return (x * (weight * inverse_rms(x, eps))).to(torch.bfloat16)


def post_norm_row(h: torch.Tensor, weight: torch.Tensor | None, eps: torch.Tensor) -> torch.Tensor:
    """A sublayer's output [1, dim] as it joins the residual stream: as it is, or (Gemma 3)
    RMS-normalised in float32 and kept in float32."""
    if weight is None:
        return h
    h = h.float()
    return h * (weight * inverse_rms(h, eps))


def inverse_rms(x: torch.Tensor, eps: torch.Tensor, matmul: bool | None = None) -> torch.Tensor:
    """1 / RMS of one row x [1, dim] float32 -> [1, 1]. On the CPU (`matmul`) one matmul,
    x·xᵀ/dim + eps: 5 ops where F.rms_norm and a cast run 9, and inductor fuses them into one
    loop. On a GPU a reduction, which inductor fuses with the scaling around it, where the
    matmul would be a cuBLAS kernel of its own in every norm of every layer."""
    if matmul is None:
        matmul = x.device.type == "cpu"
    if matmul:
        return torch.addmm(eps, x, x.t(), alpha=1 / x.shape[1]).rsqrt()
    return (x.square().mean(-1, keepdim=True) + eps).rsqrt()


def qk_norm(qk: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """q and k heads [n, h + kv_h, d] each RMS-normalised over their values, float32 (as
    RoPE works anyway); weight [h + kv_h, d]: q's norm per query head, then k's per key head."""
    qk = qk.float()
    return qk * (qk.square().mean(-1, keepdim=True) + eps).rsqrt() * weight


def rotate(x: torch.Tensor, rope: Sequence[torch.Tensor]) -> torch.Tensor:
    """RoPE (rotate-half layout) in float32, out in bf16: x [n, heads, d] by (matrices
    [n, d, d],) as row vectors x·M, or by (cos, sin) [n, 1, d], sin with its first half
    negated, as x·cos + roll(x, d/2)·sin (= rotate_half(x)·sin)."""
    x = x.float()
    if len(rope) == 1:
        return torch.matmul(x, rope[0]).to(torch.bfloat16)
    cos, sin = rope
    # not addcmul: its fused multiply-add rounds differently from the reference formula
    return (x * cos + x.roll(x.shape[-1] // 2, -1) * sin).to(torch.bfloat16)


def glu(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """The gated unit of a fused gate/up product [n, 2·ffn] -> [n, ffn]."""
    ffn = gate_up.shape[-1] // 2
    gate = gate_up[:, :ffn]
    activated = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    return activated * gate_up[:, ffn:]


# Up to this many new positions, RoPE is one batched matmul with a rotation matrix per position
# (3 ops, cheaper than the elementwise form for a decode step); more, and the matrices cost more.
ROPE_MATRIX_ROWS = 8


def rope_matrix_rows(device: torch.device) -> int:
    """ROPE_MATRIX_ROWS on the CPU; none on a GPU, where the elementwise form fuses with its
    neighbours inside the compiled step and a matrix product is a kernel of its own."""
    return ROPE_MATRIX_ROWS if device.type == "cpu" else 0


class Rope:
    """Rotary position embedding for positions start..start+n-1, rotate-half layout, float32.

    Built once per forward pass, applied in every layer. x [n, heads, d] bf16 -> same, rotated.
    """

    def __init__(
        self, inv_freq: torch.Tensor, start: int, n: int, matrix_rows: int = ROPE_MATRIX_ROWS
    ) -> None:
        positions = torch.arange(start, start + n, device=inv_freq.device, dtype=torch.float32)
        self._build(positions, inv_freq, n <= matrix_rows)

    @classmethod
    def at(cls, positions: torch.Tensor, inv_freq: torch.Tensor, matrix: bool) -> Rope:
        """The rotation of positions held in a tensor [n] (a GPU step's, on the device)."""
        rope = cls.__new__(cls)
        rope._build(positions.float(), inv_freq, matrix)
        return rope

    def _build(self, positions: torch.Tensor, inv_freq: torch.Tensor, matrix: bool) -> None:
        angles = torch.outer(positions, inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[:, None]  # [n, 1, d]
        cos, sin = angles.cos(), angles.sin()
        half = inv_freq.shape[0]
        # rotate_half(x)·sin = roll(x, half)·(sin with its first half negated)
        self.cos = cos
        self.sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        self.matrix = rotation_matrices(cos[:, 0], sin[:, 0]) if matrix else None

    def row(self, i: int) -> Rope:
        """Position start + i's rotation alone: views of this one's tensors."""
        rope = Rope.__new__(Rope)
        rope.cos, rope.sin = self.cos[i : i + 1], self.sin[i : i + 1]
        rope.matrix = self.matrix[i : i + 1] if self.matrix is not None else None
        return rope

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What layer.rotate takes: (matrices,) or (cos, signed sin)."""
        return (self.matrix,) if self.matrix is not None else (self.cos, self.sin)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.tensors())


def rotation_matrices(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """[n, d] cos and sin -> [n, d, d] matrices M with x·M = x·cos + rotate_half(x)·sin."""
    d, device = cos.shape[-1], cos.device
    # Made once for the eager steps; a graph being compiled (the GPU's static step) makes them
    # inside the graph, where a cached host object has no place.
    basis = _rotation_basis if torch.compiler.is_compiling() else _kept_rotation_basis
    eye, rotate = basis(d, device)
    return eye * cos[:, None, :] + rotate * sin[:, None, :]


def _rotation_basis(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The identity and the rotate_half matrix (rotate_half(x) = x·rotate), [d, d] each."""
    half = d // 2
    rotate = torch.zeros(d, d, device=device)
    index = torch.arange(half, device=device)
    rotate[index + half, index] = -1.0
    rotate[index, index + half] = 1.0
    return torch.eye(d, device=device), rotate


_kept_rotation_basis = functools.lru_cache(maxsize=8)(_rotation_basis)
