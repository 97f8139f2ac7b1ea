"""What a GGUF holds, as Glassbox's builders read it: the model's shape (or why it cannot run),
a tensor's raw rows in transformers' order, and handing freed memory back between tensors.

llama.cpp's converter stores the q and k weights of `llama` models with the rows of each head
interleaved for its RoPE layout; rows are independent in every GGUF type, so they are put back
in transformers' order (rotate-half RoPE) by reordering raw rows, exactly, before anything is
dequantised or repacked. Both builders (engine/model/fast_builder.py, engine/model/reference.py)
read through here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from engine.gguf.reader import GGUFFile
from engine.model.llama import LlamaShape

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# Gemma 3's layers attend within a window but every GEMMA_GLOBAL-th, which sees everything:
# the file does not say so; llama.cpp (set_swa_pattern(6)) and transformers both assume it.
GEMMA_GLOBAL = 6
GEMMA_LOCAL_ROPE_BASE = 10000.0  # the sliding layers' RoPE base (also not in the file)
# Called per tensor: (tensors done, tensors in all).
TensorProgress = Callable[[int, int], None]


class Unsupported(ValueError):
    """The GGUF holds a model the own engine cannot run; the message says what."""


def read_shape(file: GGUFFile) -> LlamaShape:
    """The model's dimensions from the metadata, or Unsupported with the reason."""
    arch = file.get("general.architecture", "?")
    if arch not in ARCHITECTURES:
        raise Unsupported(f"architecture '{arch}' (the own engine runs {', '.join(ARCHITECTURES)})")

    def meta(key: str, default: Any = None) -> Any:  # a metadata value, as the file types it
        value = file.get(f"{arch}.{key}", default)
        if value is None:
            raise Unsupported(f"metadata {arch}.{key} is missing")
        return value

    scaling = file.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise Unsupported(f"RoPE scaling '{scaling}'")
    dim, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(meta("attention.key_length", dim // heads))
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise Unsupported("partial RoPE (rotary dimensions below the head size)")
    if "token_embd.weight" not in file.tensors:
        raise Unsupported("no token_embd.weight tensor")
    shape = LlamaShape(
        vocab=file.tensors["token_embd.weight"].shape[0],
        dim=dim,
        layers=int(meta("block_count")),
        heads=heads,
        kv_heads=int(meta("attention.head_count_kv", heads)),
        head_dim=head_dim,
        ffn=int(meta("feed_forward_length")),
        eps=float(meta("attention.layer_norm_rms_epsilon")),
        rope_base=float(meta("rope.freq_base", 10000.0)),
        context=int(meta("context_length", 2048)),
        architecture=arch,
        parameters=sum(math.prod(info.shape) for info in file.tensors.values()),
    )
    return _gemma_shape(shape, int(meta("attention.sliding_window"))) if arch == "gemma3" else shape


def _gemma_shape(shape: LlamaShape, window: int) -> LlamaShape:
    """Gemma 3's sliding layers, window and q·k scale, as llama.cpp reads them: the scale is
    head_dim ** -0.5, but (dim / heads) ** -0.5 on the 62-layer 27B (query_pre_attn_scalar)."""
    layers = tuple(i for i in range(shape.layers) if (i + 1) % GEMMA_GLOBAL)
    scalar = shape.dim // shape.heads if shape.layers == 62 else shape.head_dim
    return dataclasses.replace(
        shape,
        sliding_layers=layers,
        sliding_window=window,
        local_rope_base=GEMMA_LOCAL_ROPE_BASE,
        query_scale=scalar**-0.5,
    )


def raw_rows(file: GGUFFile, shape: LlamaShape, name: str) -> torch.Tensor:
    """A tensor's raw rows (uint8 [rows, row_bytes]) in transformers' row order."""
    rows = torch.from_numpy(file.read(name))
    if shape.architecture != "llama":  # only llama's converter permutes
        return rows
    if name.endswith("attn_q.weight"):
        return _unpermute(rows, shape.heads)
    if name.endswith("attn_k.weight"):
        return _unpermute(rows, shape.kv_heads)
    return rows


def _unpermute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head (d/2, 2) -> (2, d/2) row interleave (as transformers does)."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).transpose(1, 2).reshape(rows.shape)


def release_freed_memory() -> bool:
    """Hand the repacking's freed temporaries back to the OS (glibc keeps them otherwise:
    100 MB of resident memory on the bundled model, more than its weights); whether it could
    (False without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return trim is not None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None elsewhere. Looked up once: find_library runs ldconfig,
    a process each call, and loading calls this after every chunk."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return None
