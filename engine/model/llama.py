"""Glassbox's own Llama-family model (Llama, SmolLM, Mistral, Qwen2) running on quantised weights.

Plain torch in the style of gpt-fast: the weights stay in the GGUF's 4/8-bit blocks and go
through int4/int8 CPU kernels (engine/weights/linear.py); activations run in bf16, the residual
stream in float32. Keys and values live in a KVBuffer that grows in place. The probes see this
model's own numbers: attention from its q and k, logits from its lm_head, bytes from its cache.

Shapes: B = 1 always, so the residual stream is [n, dim]; n = new positions; T = positions
in the cache after this pass. A decode step is ~40 small ops per layer, each costing a few
microseconds of dispatch here, so the code below counts ops (see Rope, rms_norm, Head), and
calls submodules through `.forward`: nn.Module.__call__'s hook checks, ~210 calls a step,
are a noticeable share of a decode step's CPU time (no hooks are ever set on this model).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.model import largest
from engine.model.attention_probe import AttentionProbe, attention_weights
from engine.model.kv_buffer import KVBuffer
from engine.model.layer import (
    ROPE_MATRIX_ROWS,
    LayerForm,
    LayerOps,
    LayerWeights,
    Rope,
    decode_layer,
    glu,
    norm_row,
    post_norm_row,
    qk_norm,
)
from engine.model.prompt_attention import prompt_attention
from engine.weights import ggml_kernel
from engine.weights.linear import Linear, RowReader

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LlamaShape:
    vocab: int
    dim: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    eps: float
    rope_base: float
    context: int
    architecture: str = "llama"
    parameters: int = 0  # weights in the file (as transformers counts them)
    # Gemma 3 only (the defaults leave the Llama family as it was):
    sliding_layers: tuple[int, ...] = ()  # layers that attend within a window
    sliding_window: int = 0  # keys a sliding layer's query sees, itself included
    local_rope_base: float = 10000.0  # RoPE base of the sliding layers
    query_scale: float = 0.0  # q·k scale; 0: head_dim ** -0.5


class StaticStep(Protocol):
    """A one-token pass with every shape fixed, for a GPU to capture (engine/step/static.py):
    run() returns the logits [vocab], or None where it cannot take the pass."""

    def new_cache(self) -> KVBuffer: ...

    def run(
        self, ids: torch.Tensor, cache: KVBuffer, probe: AttentionProbe | None
    ) -> torch.Tensor | None: ...


StepOutputs = tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]


class DecodeStep(Protocol):
    """Every layer of a one-token pass in one call (engine/step/compiled.py builds one):
    x [1, dim], the pass's rotations (one per RoPE base), the position and the cache -> x
    after the last layer, each layer's query [1, heads, 1, d] and each layer's output
    [layers, dim] float32 (StepOutputs: what the probes and a logit lens read)."""

    def __call__(
        self, x: torch.Tensor, ropes: tuple[Rope, ...], start: int, cache: KVBuffer
    ) -> StepOutputs: ...


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """float32 [n, dim] -> RMS-normalised and scaled in float32, out in bf16: one position
    (a decode step) as layer.norm_row, a matmul for the mean square; more take the fused op."""
    if x.shape[0] == 1:
        return norm_row(x, weight, eps_tensor(eps, x.device))
    return F.rms_norm(x, weight.shape, weight, eps).to(torch.bfloat16)


def final_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm before the head, float32 [n, dim] -> bf16. Where the GGML kernels load, their
    `norm_rows` (one call where torch runs five ops; each row alone, so a batch's rows equal
    one position's); elsewhere rms_norm."""
    if _norm_in_kernels(x, weight):
        normed: torch.Tensor = torch.ops.glassbox.norm_rows(x, weight, eps)
        return normed
    return rms_norm(x, weight, eps)


def final_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """final_norm of each row [n, dim] as a one-position pass norms it (the logit lens's layers,
    whose last must be the pass's own)."""
    if _norm_in_kernels(x, weight):
        return final_norm(x, weight, eps)
    return torch.cat([rms_norm(row[None], weight, eps) for row in x])


def _norm_in_kernels(x: torch.Tensor, weight: torch.Tensor) -> bool:
    on_cpu = x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
    return on_cpu and ggml_kernel.ensure() is None


def post_norm(h: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """A sublayer's output [n, dim] as it joins the residual stream (layer.post_norm_row for
    one position): as it is, or RMS-normalised in float32 where a block has the norm."""
    if weight is None or h.shape[0] == 1:
        return post_norm_row(h, weight, eps_tensor(eps, h.device))
    return F.rms_norm(h.float(), weight.shape, weight, eps)


@functools.cache
def eps_tensor(eps: float, device: torch.device) -> torch.Tensor:
    return torch.full((1, 1), eps, device=device)


@dataclass(frozen=True)
class Pass:
    """What every layer of one forward pass shares: the positions' rotations (one per RoPE
    base: a block takes `ropes[block.rope]`), the cache its keys and values go to (None in the
    no-cache teaching mode), its first position, the probe."""

    ropes: tuple[Rope, ...]
    cache: KVBuffer | None
    start: int
    probe: AttentionProbe | None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention of queries at positions start.. over keys 0..T-1.

    q: [1, h, n, d]; k, v: [1, kv_h, T, d] -> [1, h, n, d].
    """
    n, total = q.shape[2], k.shape[2]
    if n == 1:
        return decode_attention(q, k, v)
    if start == 0:
        mask, causal = None, True
    else:  # a prompt after reused positions: row i sees keys up to start + i
        rows = torch.arange(start, total, device=q.device)[:, None]
        mask, causal = torch.arange(total, device=q.device)[None, :] <= rows, False
    return prompt_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


# From this many keys, a decode step's attention runs as two bf16 matmuls instead of SDPA on
# float32 copies: copies of a long cache no longer fit in the CPU's caches (see below).
LONG_DECODE_KEYS = 1024


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """One query over the whole cache: q [1, h, 1, d], k and v [1, kv_h, T, d] -> [1, h, 1, d],
    scores scaled by `scale` (default d ** -0.5).

    torch's CPU attention kernel is slow in bf16 for a single query at long contexts, under the
    AVX2 and the AVX-512 kernel sets alike. On float32 copies it is fast while they fit in the
    CPU's caches, then not, once the copies outgrow them at long contexts. Past
    LONG_DECODE_KEYS, two batched bf16 matmuls read the cache as it is, each group of query
    heads against its key head, with the softmax in float32, faster than either.
    """
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[3]
    if k.shape[2] < LONG_DECODE_KEYS:
        gqa = kv_heads != heads
        y = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), scale=scale, enable_gqa=gqa
        )
        return y.to(q.dtype)
    grouped = q.view(kv_heads, heads // kv_heads, d)  # query heads of one key head together
    scores = torch.matmul(grouped, k[0].transpose(1, 2)).float().mul_(scale or d**-0.5)
    weights = scores.softmax(-1).to(v.dtype)  # [kv_h, h / kv_h, T]
    return torch.matmul(weights, v[0]).view(1, heads, 1, d)


class Attention(nn.Module):
    bias: torch.Tensor | None  # buffers, declared for the type checker
    qk_norm: torch.Tensor | None
    window: int | None = None  # keys a query sees on a sliding layer; None: every key
    scale: float | None = None  # q·k scale; None: head_dim ** -0.5

    def __init__(
        self, shape: LlamaShape, qkv: Linear, out: Linear, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        self.qkv, self.out = qkv, out  # qkv: q, k, v projections fused into one matmul
        self.register_buffer("bias", bias, persistent=False)  # Qwen2 has q/k/v biases
        self.register_buffer("qk_norm", None, persistent=False)  # QKNormAttention's
        self.heads, self.kv_heads, self.head_dim = shape.heads, shape.kv_heads, shape.head_dim
        self.eps = shape.eps

    def forward(self, x: torch.Tensor, layer: int, where: Pass, rope: Rope) -> torch.Tensor:
        """A pass of n positions (the prompt's; one position goes through layer.decode_layer)
        with the same pieces: x [n, dim] bf16 -> [n, dim]."""
        n, d = x.shape[0], self.head_dim
        qkv = self.qkv.forward(x)  # [n, (h + 2·kv_h)·d]
        if self.bias is not None:
            qkv = qkv + self.bias
        qk_heads = self.heads + self.kv_heads
        qk = qkv[:, : qk_heads * d].view(n, qk_heads, d)
        if self.qk_norm is not None:
            qk = qk_norm(qk, self.qk_norm, eps_tensor(self.eps, x.device))
        qk = rope(qk).transpose(0, 1)[None]  # [1, heads, n, d]
        q, k = qk[:, : self.heads], qk[:, self.heads :]  # [1, h, n, d], [1, kv_h, n, d]
        v = qkv[:, qk_heads * d :].view(n, self.kv_heads, d).transpose(0, 1)[None]
        k, v = self.write(k, v, layer, where)
        self.watch(q, k, layer, where)
        y = self.attend(q, k, v, where.start)
        return self.out.forward(y[0].transpose(0, 1).reshape(n, self.heads * d))

    def write(
        self, k: torch.Tensor, v: torch.Tensor, layer: int, where: Pass
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pass's keys and values into the cache: the ones its queries see."""
        return (k, v) if where.cache is None else where.cache.write(layer, where.start, k, v)

    def watch(self, q: torch.Tensor, k: torch.Tensor, layer: int, where: Pass) -> None:
        """The probe's weights of this layer, if it watches it, from the q and k attended with."""
        probe = where.probe
        if probe is not None and probe.wants(layer):
            probe.weights[layer] = self.probe_weights(q, k, where.start, probe.rows)

    def ops(self, block: Block, layer: int, where: Pass) -> LayerOps:
        """How the eager forward runs layer.decode_layer: the model's own linears, the pass's
        rotation, the cache's write, this attention (and the probe)."""

        def write(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.write(k, v, layer, where)

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.watch(q, k, layer, where)
            return self.attend(q, k, v, where.start)

        return LayerOps(block.multiply, where.ropes[block.rope], write, attend)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Causal attention over every key: [1, h, n, d]."""
        return attend(q, k, v, start)

    def probe_weights(
        self, q: torch.Tensor, k: torch.Tensor, start: int, rows: int
    ) -> torch.Tensor:
        """The attention weights of a watched layer's last `rows` queries, as attend weighs."""
        return attention_weights(q, k, None, self.head_dim**-0.5, rows)


class QKNormAttention(Attention):
    """Attention whose q and k heads are each RMS-normalised over their values before RoPE
    (Qwen3's q_norm/k_norm, Gemma 3's QK-norm): layer.qk_norm."""

    qk_norm: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, shape: LlamaShape, qkv: Linear, out: Linear, qk_norm: torch.Tensor) -> None:
        super().__init__(shape, qkv, out, None)
        # [h + kv_h, d] float32: q's norm weights once per query head, then k's per key head
        self.register_buffer("qk_norm", qk_norm, persistent=False)


def qk_norm_weights(shape: LlamaShape, q_norm: torch.Tensor, k_norm: torch.Tensor) -> torch.Tensor:
    """The [d] q and k norm weights laid out per head as QKNormAttention applies them."""
    return torch.cat([q_norm.expand(shape.heads, -1), k_norm.expand(shape.kv_heads, -1)])


class FeedForward(nn.Module):
    gelu = False  # SwiGLU; GeGLU where True (layer.glu)

    def __init__(self, gate_up: Linear, down: Linear, ffn: int) -> None:
        super().__init__()
        self.gate_up, self.down, self.ffn = gate_up, down, ffn  # gate and up fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down.forward(glu(self.gate_up.forward(x), self.gelu))


class Block(nn.Module):
    """One decoder layer: one position through layer.decode_layer, more through the same
    pieces with the prompt's attention (Attention.forward)."""

    attention_norm: torch.Tensor  # buffers, declared for the type checker
    ffn_norm: torch.Tensor
    post_attention_norm: torch.Tensor | None
    post_ffn_norm: torch.Tensor | None
    rope = 0  # which of a pass's rotations this layer takes (Gemma's sliding layers: 1)

    def __init__(
        self,
        attention: Attention,
        feed_forward: FeedForward,
        norms: tuple[torch.Tensor, torch.Tensor],
        eps: float,
    ) -> None:
        super().__init__()
        self.attention, self.feed_forward = attention, feed_forward
        self.register_buffer("attention_norm", norms[0], persistent=False)
        self.register_buffer("ffn_norm", norms[1], persistent=False)
        self.register_buffer("post_attention_norm", None, persistent=False)  # Gemma's
        self.register_buffer("post_ffn_norm", None, persistent=False)
        self.eps = eps
        a = attention
        self.form = LayerForm(a.heads, a.kv_heads, a.head_dim, gelu=feed_forward.gelu)

    def forward(self, x: torch.Tensor, layer: int, where: Pass) -> torch.Tensor:
        if x.shape[0] == 1:
            ops = self.attention.ops(self, layer, where)
            x, _ = decode_layer(x, self.weights(), self.form, eps_tensor(self.eps, x.device), ops)
            return x
        h = rms_norm(x, self.attention_norm, self.eps)
        h = self.attention.forward(h, layer, where, where.ropes[self.rope])
        x = x + post_norm(h, self.post_attention_norm, self.eps)
        h = self.feed_forward.forward(rms_norm(x, self.ffn_norm, self.eps))
        return x + post_norm(h, self.post_ffn_norm, self.eps)

    def weights(self) -> LayerWeights:
        """The layer's tensors besides its linears, as layer.decode_layer takes them."""
        a = self.attention
        return LayerWeights(self.attention_norm, self.ffn_norm, a.bias, a.qk_norm,
                            self.post_attention_norm, self.post_ffn_norm)  # fmt: skip

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv, out, gate_up, down: layer.QKV..DOWN (read at each call: to_device swaps them)."""
        a, f = self.attention, self.feed_forward
        return a.qkv, a.out, f.gate_up, f.down

    def multiply(self, which: int, x: torch.Tensor) -> torch.Tensor:
        """layer.LayerOps.multiply with the model's own linears."""
        return self.linears()[which].forward(x)


class Embedding(nn.Module):
    """Token embeddings kept in the file's compact rows; only the looked-up rows are expanded."""

    rows: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, rows: RowReader) -> None:
        super().__init__()
        self.register_buffer("rows", rows.raw, persistent=False)
        self.lookup = rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids.reshape(-1))  # [n, dim] float32

    def table(self) -> torch.Tensor:
        """Every token's row [vocab, dim] float32, as forward returns them (a GPU step's)."""
        return self.lookup.all()


class Head(nn.Module):
    """The lm_head: every logit from a 4-bit matmul, the likeliest ones recomputed exactly.

    The int4 kernel rounds its output to bf16, 0.06 apart at a logit of 16, enough to swap
    close candidates: on the bundled model it agreed with the exact model's top-1 on only
    96.4% of a 690-token text. So the `candidates` highest logits are recomputed in float32
    from the file's own rows (dequantised on the spot): 98.8%. The rest keep the matmul's.
    """

    rows: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, bulk: Linear, rows: RowReader, candidates: int = 64) -> None:
        super().__init__()
        self.bulk, self.lookup, self.candidates = bulk, rows, candidates
        self.register_buffer("rows", rows.raw, persistent=False)  # the file's [vocab, bytes]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [n, dim] (bf16) -> logits [n, vocab] float32."""
        logits = self.bulk.forward(x)
        if self._in_kernels(logits):  # the same steps in one C++ call, the dots in double
            exact: torch.Tensor = torch.ops.glassbox.exact_head(
                logits, self.rows, self.lookup.qtype, x, self.candidates
            )
            return exact
        top = largest.top_k_rows(logits, self.candidates)  # [n, c]
        weights = self.lookup(top.reshape(-1)).view(*top.shape, -1)  # [n, c, dim]
        exact = (weights @ x.float()[..., None])[..., 0]  # [n, c]
        return logits.float().scatter_(-1, top, exact)

    def _in_kernels(self, logits: torch.Tensor) -> bool:
        """Whether the kernels' exact_head takes this product: on the CPU, rows the kernels
        read, and a top k that top_k_rows would take the same way."""
        vocab = logits.shape[-1]
        return (
            logits.device.type == "cpu"
            and isinstance(self.lookup, RowReader)
            and self.lookup.in_kernels
            and vocab % largest.WIDTH == 0
            and self.candidates <= vocab // largest.WIDTH
        )


ROPE_CHUNK = 16  # positions whose rotations a decode step's RopeRows makes at once


class RopeRows:
    """One-token passes' rotations about one base, made ROPE_CHUNK positions at a time: a Rope
    is some fifteen small ops, each tens of microseconds between two decode steps (the caches
    hold the weights then); a step takes its position's row, views of the chunk's tensors."""

    def __init__(self, inv_freq: torch.Tensor, matrix: bool) -> None:
        self.inv_freq, self.matrix = inv_freq, matrix  # matrix: rotate by matrices (Rope)
        self.first = -1  # the chunk's first position
        self.chunk: Rope | None = None

    def at(self, position: int) -> Rope:
        first = position - position % ROPE_CHUNK
        if self.chunk is None or first != self.first:
            rows = ROPE_CHUNK if self.matrix else 0
            self.chunk, self.first = Rope(self.inv_freq, first, ROPE_CHUNK, rows), first
        return self.chunk.row(position - first)


class GGUFLlama(nn.Module):
    """The model behind `fast` precision: forward(ids, cache, probe) -> last position's logits."""

    norm: torch.Tensor  # buffers, declared for the type checker
    inv_freq: torch.Tensor
    # Why compiled_decode's step (Llama's ops, written flat) cannot run this model, if not
    compile_refusal: str | None = None
    rope_matrix_rows = ROPE_MATRIX_ROWS  # passes up to this long rotate by matrices (see Rope)

    def __init__(self, shape: LlamaShape, embedding: Embedding, blocks: list[Block],
                 norm: torch.Tensor, output: Head, inv_freq: torch.Tensor) -> None:  # fmt: skip
        super().__init__()
        self.shape = shape
        self.embedding, self.blocks, self.output = embedding, nn.ModuleList(blocks), output
        self.register_buffer("norm", norm, persistent=False)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [d / 2] float32
        self.cache_dtype = torch.bfloat16
        # one-token passes through a cache run here once compiled (engine/step/compiled.py)
        self.decode_step: DecodeStep | None = None
        # one-token passes on a GPU go through a static step instead (engine/step/static.py)
        self.static_step: StaticStep | None = None
        # called with a layer's index (the head's: the layer count) before it runs, when some
        # are placed on disk (engine/placement/mapped.py); the compiled step is then refused
        self.read_in: Callable[[int], None] | None = None
        # while a logit lens is watched (engine/model/lens.py), given every layer's output at
        # the pass's last position [layers, dim] by whichever step ran the pass
        self.keep_residuals: Callable[[torch.Tensor], None] | None = None
        self._rope_rows: tuple[RopeRows, ...] | None = None  # one-token passes' rotations

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def new_cache(self) -> KVBuffer:
        if self.static_step is not None:
            return self.static_step.new_cache()
        s = self.shape
        return KVBuffer(s.layers, s.kv_heads, s.head_dim, self.cache_dtype, self.device)

    @torch.no_grad()
    def forward(
        self,
        ids: torch.Tensor,
        cache: KVBuffer | None,
        probe: AttentionProbe | None,
        every_position: bool = False,
    ) -> torch.Tensor:
        """ids [1, n] after the cache's positions (or the whole sequence without a cache).

        Returns the last position's logits [vocab] (float32), or [n, vocab] for every position.
        """
        start, n = (cache.length if cache is not None else 0), ids.shape[1]
        if self.static_step is not None and cache is not None and n == 1 and start:
            logits = self.static_step.run(ids, cache, probe)
            if logits is not None:
                return logits[None] if every_position else logits
        if cache is not None:
            cache.reserve(start + n)
        x = self.embedding.forward(ids)  # [n, dim] float32
        x = self._layers(x, Pass(self.ropes(start, n), cache, start, probe))
        if cache is not None:
            cache.length = start + n
        if not every_position:
            x = x[-1:]
        if self.read_in is not None:
            self.read_in(self.shape.layers)
        logits = self.output.forward(final_norm(x, self.norm, self.shape.eps))
        return logits if every_position else logits[-1]

    def frequencies(self) -> tuple[torch.Tensor, ...]:
        """RoPE's inverse frequencies [d / 2] per base a layer may take (Block.rope)."""
        return (self.inv_freq,)

    def ropes(self, start: int, n: int) -> tuple[Rope, ...]:
        """The rotations of positions start..start+n-1, one per base (Block.rope); a one-token
        pass's from its base's RopeRows."""
        if n != 1:
            return tuple(Rope(f, start, n, self.rope_matrix_rows) for f in self.frequencies())
        bases = self.frequencies()
        kept = self._rope_rows
        if kept is None or any(r.inv_freq is not f for r, f in zip(kept, bases, strict=True)):
            matrix = self.rope_matrix_rows >= 1  # (new buffers: the model moved)
            kept = self._rope_rows = tuple(RopeRows(f, matrix) for f in bases)
        return tuple(rows.at(start) for rows in kept)

    def _layers(self, x: torch.Tensor, where: Pass) -> torch.Tensor:
        """Every block, through the compiled step when it can take this pass: one token after
        at least one cached position (what it was compiled for)."""
        cache = where.cache
        if self.decode_step is not None and x.shape[0] == 1 and cache is not None and where.start:
            try:
                return self._compiled_layers(self.decode_step, x, where, cache)
            except RuntimeError as error:  # inputs it was not compiled for: eager from now on
                log.warning("the compiled decode step failed, decoding eagerly: %s", error)
                self.decode_step = None
        read_in, keep = self.read_in, self.keep_residuals
        outputs = []  # each layer's last position, while a lens keeps them
        for layer, block in enumerate(self.blocks):
            if read_in is not None:
                read_in(layer)
            x = block.forward(x, layer, where)
            if keep is not None:
                outputs.append(x[-1])
        if keep is not None:
            keep(torch.stack(outputs))
        return x

    def _compiled_layers(
        self, step: DecodeStep, x: torch.Tensor, where: Pass, cache: KVBuffer
    ) -> torch.Tensor:
        """One token through the compiled step; a watched layer's attention from the queries
        it returns and the keys it wrote, a watched lens's residuals from its layers' outputs."""
        start, probe = where.start, where.probe
        cache.reserve(start + 2)  # it was compiled for a cache with room after this position
        x, queries, residuals = step(x, where.ropes, start, cache)
        if probe is not None:
            self.watch(probe, queries, cache, start)
        if self.keep_residuals is not None:
            self.keep_residuals(residuals)
        return x

    def watch(
        self,
        probe: AttentionProbe,
        queries: list[torch.Tensor],
        cache: KVBuffer,
        start: int,
        reused: bool = False,
    ) -> None:
        """Watched layers' attention after a fast step (compiled or static), from the queries
        it returned and the keys it cached for the position `start`: weighed now, or left in
        the probe for later where it takes them and the cache keeps every position (a sliding
        layer's cache drops old ones). `reused`: the queries are a graph's outputs, overwritten
        by its next replay (kept as copies)."""
        later = probe.queries if cache.keeps_positions else None
        for layer in sorted(probe.layers):
            if layer >= len(queries):
                continue
            if later is not None:
                later[layer] = queries[layer].clone() if reused else queries[layer]
            else:
                probe.weights[layer] = self.weigh(layer, queries[layer], start, cache)

    def weigh(self, layer: int, queries: torch.Tensor, start: int, cache: KVBuffer) -> torch.Tensor:
        """[heads, n, keys]: layer `layer`'s attention weights of the queries [1, heads, n, d]
        of positions start..start+n-1 over the keys cached for them."""
        n = queries.shape[2]
        keys, _ = cache.held(layer, start, start + n)
        attention = cast("Attention", self.blocks[layer].attention)
        return attention.probe_weights(queries, keys, start, n)

    def weight_bytes(self) -> int:
        """Bytes of the weights a decode step reads (the mapped lookup rows excluded)."""
        mapped = {self.embedding.rows.data_ptr(), self.output.rows.data_ptr()}
        return sum(
            b.numel() * b.element_size() for b in self.buffers() if b.data_ptr() not in mapped
        )
