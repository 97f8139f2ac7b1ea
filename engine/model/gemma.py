"""Gemma 3 in Glassbox's own model: the Llama blocks of engine/model/llama.py with Gemma's extras.

What Gemma 3 adds to a Llama block, each as transformers' Gemma3 and llama.cpp compute it:
- the token embedding scaled by √dim (a float32 constant, as transformers' float32 model);
- RMSNorm scales of (1 + w): llama.cpp's converter stores 1 + w in the GGUF already, so the
  Llama rms_norm reads them as they are;
- QK-norm: each head of q and of k RMS-normalised over its values before RoPE;
- norms after attention and after the feed-forward, before each joins the residual stream;
- GeGLU: gelu (tanh approximation) of the gate instead of silu;
- sliding-window layers: a query sees only the last `sliding_window` keys, itself included;
  they rotate with RoPE base 10,000, the global layers with the file's own base;
- q·k scaled by query_pre_attn_scalar ** -0.5 (head_dim ** -0.5 but on 27B).
The Llama classes are left untouched: these are subclasses, so a Llama decode step runs the
ops it ran before.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from engine.model import llama
from engine.model.attention_probe import attention_weights
from engine.model.kv_buffer import WindowedKVBuffer
from engine.model.llama import (
    Pass,
    QKNormAttention,
    Rope,
    decode_attention,
    eps_tensor,
    rms_norm,
)
from engine.weights.linear import Linear, RowReader


def visible(
    k: torch.Tensor, v: torch.Tensor, start: int, n: int, window: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The keys and values the queries at start..start+n-1 may see, and the mask saying which.

    k, v: [1, kv_h, K, d], the last K positions before start + n (a cache may hold fewer than
    all). One query (a decode step) sees the last `window` keys: a view, no mask. More queries
    get a bool mask [1, 1, n, K]: causal, and within the window on a sliding layer.
    """
    if n == 1:
        if window is not None and k.shape[2] > window:
            k, v = k[:, :, -window:], v[:, :, -window:]
        return k, v, None
    end = start + n
    keys = torch.arange(end - k.shape[2], end, device=k.device)[None, :]  # their positions
    rows = torch.arange(start, end, device=k.device)[:, None]
    allowed = keys <= rows
    if window is not None:
        allowed &= keys > rows - window
    return k, v, allowed[None, None]


def attend_window(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of queries at positions start.. over the keys they may see (within
    `window` on a sliding layer). q: [1, h, n, d]; k, v: [1, kv_h, K, d] -> [1, h, n, d]."""
    k, v, mask = visible(k, v, start, q.shape[2], window)
    if q.shape[2] == 1:  # a decode step: the keys it sees, no mask (llama.decode_attention)
        return decode_attention(q, k, v, scale)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


class GemmaAttention(QKNormAttention):
    def __init__(
        self,
        shape: llama.LlamaShape,
        qkv: Linear,
        out: Linear,
        qk_norm: torch.Tensor,
        window: int | None,
    ) -> None:
        super().__init__(shape, qkv, out, qk_norm)
        self.window = window
        self.scale = shape.query_scale or shape.head_dim**-0.5

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """Attention over the keys each query sees (within the window on a sliding layer)."""
        return attend_window(q, k, v, start, self.window, self.scale)  # [1, h, n, d]

    def probe_weights(
        self, q: torch.Tensor, k: torch.Tensor, start: int, rows: int
    ) -> torch.Tensor:
        seen, _, mask = visible(k, k, start, q.shape[2], self.window)
        return attention_weights(q, seen, mask, self.scale, rows)


class GemmaFeedForward(llama.FeedForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up.forward(x)
        gate = F.gelu(gate_up[:, : self.ffn], approximate="tanh")
        return self.down.forward(gate * gate_up[:, self.ffn :])


def post_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A sublayer's bf16 output [n, dim] RMS-normalised in float32, kept in float32 for the
    residual stream it joins. One position (a decode step, 36 calls in Gemma-3-270M) as
    llama.rms_norm does it: the mean square as one matmul, 3 ops where F.rms_norm runs ~9."""
    h = h.float()
    if h.shape[0] != 1:
        return F.rms_norm(h, weight.shape, weight, eps)
    inverse_rms = torch.addmm(eps_tensor(eps, h.device), h, h.t(), alpha=1 / h.shape[1]).rsqrt_()
    return h * (weight * inverse_rms)


class GemmaBlock(llama.Block):
    post_attention_norm: torch.Tensor  # buffers, declared for the type checker
    post_ffn_norm: torch.Tensor

    def __init__(
        self,
        attention: GemmaAttention,
        feed_forward: GemmaFeedForward,
        norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        eps: float,
    ) -> None:
        """norms: before attention, after it, before the feed-forward, after it."""
        super().__init__(attention, feed_forward, (norms[0], norms[2]), eps)
        self.register_buffer("post_attention_norm", norms[1], persistent=False)
        self.register_buffer("post_ffn_norm", norms[3], persistent=False)

    def forward(self, x: torch.Tensor, layer: int, where: Pass) -> torch.Tensor:
        h = rms_norm(x, self.attention_norm, self.eps)
        h = self.attention.forward(h, layer, where)
        x = x + post_norm(h, self.post_attention_norm, self.eps)
        h = self.feed_forward.forward(rms_norm(x, self.ffn_norm, self.eps))
        return x + post_norm(h, self.post_ffn_norm, self.eps)


class GemmaEmbedding(llama.Embedding):
    scale: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, rows: RowReader, dim: int) -> None:
        super().__init__(rows)
        # √dim as transformers' float32 model multiplies by it: a float32 tensor
        self.register_buffer("scale", torch.tensor(dim**0.5, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids.reshape(-1)).mul_(self.scale)  # [n, dim] float32


class GGUFGemma(llama.GGUFLlama):
    """GGUFLlama with Gemma blocks, and a second RoPE table for the sliding layers."""

    local_inv_freq: torch.Tensor  # a buffer, declared for the type checker
    compile_refusal = "gemma3's norms and window are not in the compiled step yet"
    # Never by matrices: at head_dim 256 one costs 16x the FLOPs of Llama's 64; measured here,
    # building one and rotating by it took ~60x the elementwise form's time.
    rope_matrix_rows = 0

    def __init__(self, shape: llama.LlamaShape, embedding: llama.Embedding,
                 blocks: list[llama.Block], norm: torch.Tensor, output: llama.Head,
                 inv_freq: torch.Tensor, local_inv_freq: torch.Tensor) -> None:  # fmt: skip
        super().__init__(shape, embedding, blocks, norm, output, inv_freq)
        self.register_buffer("local_inv_freq", local_inv_freq, persistent=False)
        self.sliding = frozenset(shape.sliding_layers)

    def new_cache(self) -> WindowedKVBuffer:
        """A cache whose sliding layers keep only their window."""
        s = self.shape
        return WindowedKVBuffer(s.layers, s.kv_heads, s.head_dim, self.cache_dtype, self.device,
                                sliding=s.sliding_layers, window=s.sliding_window)  # fmt: skip

    def _layers(self, x: torch.Tensor, where: Pass) -> torch.Tensor:
        """Every block, eagerly (the compiled step is Llama's): global layers rotate with
        the pass's rope, sliding ones with the local base."""
        local_rope = Rope(self.local_inv_freq, where.start, x.shape[0], self.rope_matrix_rows)
        local = dataclasses.replace(where, rope=local_rope)
        read_in = self.read_in
        for layer, block in enumerate(self.blocks):
            if read_in is not None:
                read_in(layer)
            x = block.forward(x, layer, local if layer in self.sliding else where)
        return x
