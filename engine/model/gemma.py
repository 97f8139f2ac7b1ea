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
Each is a field of engine/model/layer.py's one decoder layer (None or False for Llama), so the
eager forward, the CPU's compiled step and the GPU's static step all run Gemma's layers; these
subclasses only fill them in.
"""

from __future__ import annotations

import torch

from engine.model import llama
from engine.model.attention_probe import attention_weights
from engine.model.kv_buffer import KVBuffer, WindowedKVBuffer
from engine.model.llama import QKNormAttention, decode_attention
from engine.model.prompt_attention import prompt_attention
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
    return prompt_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


class GemmaAttention(QKNormAttention):
    scale: float

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


GLOBAL, LOCAL = 0, 1  # GGUFGemma.frequencies: the file's RoPE base, the sliding layers' base


class GemmaFeedForward(llama.FeedForward):
    gelu = True  # GeGLU: gelu (tanh approximation) of the gate


class GemmaBlock(llama.Block):
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
        self.rope = LOCAL if attention.window is not None else GLOBAL


class GemmaEmbedding(llama.Embedding):
    scale: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, rows: RowReader, dim: int) -> None:
        super().__init__(rows)
        # √dim as transformers' float32 model multiplies by it: a float32 tensor
        self.register_buffer("scale", torch.tensor(dim**0.5, dtype=torch.float32), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids.reshape(-1)).mul_(self.scale)  # [n, dim] float32

    def table(self) -> torch.Tensor:
        return self.lookup.all().mul(self.scale)


class GGUFGemma(llama.GGUFLlama):
    """GGUFLlama with Gemma blocks, and a second RoPE base for the sliding layers."""

    local_inv_freq: torch.Tensor  # a buffer, declared for the type checker
    # Never by matrices: at head_dim 256 one costs 16x the FLOPs of Llama's 64, and building
    # one and rotating by it is far slower than the elementwise form.
    rope_matrix_rows = 0

    def __init__(self, shape: llama.LlamaShape, embedding: llama.Embedding,
                 blocks: list[llama.Block], norm: torch.Tensor, output: llama.Head,
                 inv_freq: torch.Tensor, local_inv_freq: torch.Tensor) -> None:  # fmt: skip
        super().__init__(shape, embedding, blocks, norm, output, inv_freq)
        self.register_buffer("local_inv_freq", local_inv_freq, persistent=False)

    def frequencies(self) -> tuple[torch.Tensor, ...]:
        return self.inv_freq, self.local_inv_freq  # GLOBAL, LOCAL

    def new_cache(self) -> KVBuffer:
        """A cache whose sliding layers keep only their window (a static step's buckets hold
        every position: its graphs are recorded over whole buckets)."""
        if self.static_step is not None:
            return self.static_step.new_cache()
        s = self.shape
        return WindowedKVBuffer(s.layers, s.kv_heads, s.head_dim, self.cache_dtype, self.device,
                                sliding=s.sliding_layers, window=s.sliding_window)  # fmt: skip
