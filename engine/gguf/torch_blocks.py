"""GGML blocks dequantised with torch ops, on whatever device holds them.

engine/gguf/blocks.py does the bit work in numpy, which is fastest on a CPU but runs only
there: loading a K-quant model onto a GPU through it dequantised every weight on the host.
Here the same layouts (see blocks.py's table) are read with torch's integer ops, so the
file's raw blocks move to the GPU as they are stored (a quarter of bf16's bytes) and are
dequantised there. Every value equals blocks.dequantize's bit for bit (float32 scales and
offsets, w = q·scale + offset rounded once per op, as there), which the CPU tests check.
"""

from __future__ import annotations

import torch

from engine.gguf.blocks import (
    BLOCK,
    BLOCK_BYTES,
    Q4_0,
    Q4_1,
    Q4_K,
    Q5_0,
    Q5_1,
    Q5_K,
    Q6_K,
    Q8_0,
    SYMMETRIC,
)


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantised rows uint8 [rows, row_bytes] on any device -> [rows, columns] in `dtype`."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"ggml type {qtype} is not dequantised on the device")
    rows = raw.shape[0]
    blocks = raw.contiguous().view(rows, -1, BLOCK_BYTES[qtype])
    if qtype == Q6_K:
        q6, scales = _q6_k(blocks)
        w = q6.view(rows, -1, 16).float().mul_(scales.view(rows, -1)[..., None])
        return w.reshape(rows, -1).to(dtype)
    if qtype in (Q4_K, Q5_K):
        q, scale, offset = _k_quant(blocks, qtype)
    else:
        q, scale, offset = _small(blocks, qtype)
    q = q.reshape(rows, -1, BLOCK)
    scale, offset = scale.reshape(rows, -1, 1), offset.reshape(rows, -1, 1)
    if qtype in SYMMETRIC:  # d·(q - z), as blocks.dequantize: the same signed zeros
        w = q.float().sub_(SYMMETRIC[qtype]).mul_(scale)
    else:
        w = q.float().mul_(scale).add_(offset)
    return w.reshape(rows, -1).to(dtype)


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte `start` of every block, as float32 [rows, blocks]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes [..., n] -> their nibbles [..., 2n]: per `run` bytes, the low nibbles, then the
    high ones."""
    grouped = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return torch.cat([grouped & 15, grouped >> 4], dim=-2).reshape(*qs.shape[:-1], -1)


def _bits(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> bits [..., n, 8] (uint8 0/1), bit i of byte j at [j, i]."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return (packed[..., None] >> shifts) & 1


def _small(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 32-value types: d (and m) first, then the values."""
    d = _f16(blocks, 0)
    if qtype == Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8), d, torch.zeros_like(d)
    has_min = qtype in (Q4_1, Q5_1)
    start = 4 if has_min else 2
    high = None
    if qtype in (Q5_0, Q5_1):  # 32 high bits, value j's in bit j (little-endian)
        high = _bits(blocks[..., start : start + 4]).flatten(-2)
        start += 4
    q = _nibbles(blocks[..., start:], 16)
    if high is not None:
        q = q | (high << 4)
    offset = _f16(blocks, 2) if has_min else -(8 if qtype == Q4_0 else 16) * d
    return q, d, offset


def _k_quant(blocks: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K super-blocks -> values [rows, supers, 256], scale and offset per 32."""
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, m = _scale_min(blocks[..., 4:16])
    if qtype == Q4_K:
        q = _nibbles(blocks[..., 16:], 32)
    else:  # 32 bytes of high bits: bit i of byte j is value 32·i + j's
        q = _nibbles(blocks[..., 48:], 32)
        high = _bits(blocks[..., 16:48]).transpose(-1, -2).reshape(q.shape)
        q = q | (high << 4)
    return q, d * sc, -(dmin * m)


def _scale_min(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes of eight 6-bit scales and mins -> float32 [..., 8] each (blocks.py's
    _scale_min, the same layout)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=-1)
    m = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=-1)
    return sc.float(), m.float()


def _q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks -> q int8 [rows, supers, 256] (-32..31) and d·sc [rows, supers, 16]."""
    # per 128 values: 64 bytes of low nibbles (values 0-63 low, 64-127 high), 32 bytes of
    # 2-bit highs (value 32·i + j in bits 2i of byte j)
    low = _nibbles(blocks[..., :128], 64)
    high = blocks[..., 128:192].reshape(*blocks.shape[:-1], 2, 1, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)[:, None]
    high = ((high >> shifts) & 3).reshape(low.shape)
    q = (low | (high << 4)).to(torch.int8) - 32
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()
    return q, _f16(blocks, 208)[..., None] * sc
