"""GGML block layouts unpacked to integers and scales, held bit for bit to gguf's reference.

Every type here decodes as w = q·scale + offset, with q a small unsigned integer and one scale
and offset per group of 32 values, except Q6_K, whose scales cover 16 values:
    Q4_0  [d][16 B nibbles]                          q 0..15   scale d      offset -8d
    Q4_1  [d][m][16 B nibbles]                       q 0..15   scale d      offset m
    Q5_0  [d][4 B high bits][16 B nibbles]           q 0..31   scale d      offset -16d
    Q5_1  [d][m][4 B high bits][16 B nibbles]        q 0..31   scale d      offset m
    Q8_0  [d][32 B int8]                             q int8    scale d      offset 0
    Q4_K  256 values: [d][dmin][12 B 6-bit sc, m][128 B nibbles]
                                                     q 0..15   scale d·sc   offset -dmin·m
    Q5_K  as Q4_K with [32 B high bits] before the nibbles, q 0..31
    Q6_K  256 values: [128 B low nibbles][64 B 2-bit highs][16 int8 sc][d]
                                                     q -32..31 scale d·sc per 16 values
(d, dmin, m: f16). In the 32-value types nibble byte j holds value j low and j + 16 high; in
the K-quants each 64 values are 32 low nibbles, then the same 32 bytes' high nibbles.
Scales and offsets come back in float32, where d·sc (11 + 8 bits) is exact, so q·scale +
offset rounds once, as gguf's dequantize does. Bit work is done in numpy: torch's uint8 shifts
and byte transposes are much slower on the CPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

BLOCK = 32  # values a scale covers (Q6_K: 16)
SUPER = 256  # values of a K-quant super-block
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 2, 3, 6, 7, 8  # ggml type ids
Q4_K, Q5_K, Q6_K = 12, 13, 14
# bytes of a block, and the values it holds
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, Q4_K: 144, Q5_K: 176, Q6_K: 210}
BLOCK_VALUES = {Q4_0: 32, Q4_1: 32, Q5_0: 32, Q5_1: 32, Q8_0: 32, Q4_K: 256, Q5_K: 256, Q6_K: 256}
# the types unpack() reads: groups of 32 values with a scale and an offset each
GROUPED = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K)
SYMMETRIC = {Q4_0: 8, Q5_0: 16, Q8_0: 0}  # w = d·(q - z): no offset of its own
BITS = {Q4_0: 4, Q4_1: 4, Q4_K: 4, Q5_0: 5, Q5_1: 5, Q5_K: 5, Q8_0: 8}

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]


def unpack(raw: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """raw uint8 [rows, row_bytes] -> q [rows, groups, 32] (uint8; int8 for Q8_0), scale and
    offset [rows, groups] float32, with w = q·scale + offset."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw.numpy()).reshape(rows, -1, BLOCK_BYTES[qtype])
    q: npt.NDArray[np.generic]  # uint8, or int8 for Q8_0
    if qtype in (Q4_K, Q5_K):
        q, scale, offset = _k_quant(blocks, qtype)
    elif qtype in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
        q, scale, offset = _small(blocks, qtype)
    else:
        raise ValueError(f"ggml type {qtype} has no 32-value groups here")
    q = q.reshape(rows, -1, BLOCK)
    tensors = (torch.from_numpy(q), torch.from_numpy(scale), torch.from_numpy(offset))
    return tensors[0], tensors[1].reshape(rows, -1), tensors[2].reshape(rows, -1)


def _f16(blocks: U8, start: int) -> F32:
    """The f16 at byte `start` of every block, as float32 [rows, blocks]."""
    return (
        np.ascontiguousarray(blocks[..., start : start + 2])
        .view(np.float16)[..., 0]
        .astype(np.float32)
    )


def _nibbles(qs: U8, run: int) -> U8:
    """Bytes [..., n] -> their nibbles [..., 2n]: per `run` bytes, the low nibbles, then the
    high ones."""
    qs = qs.reshape(*qs.shape[:-1], -1, 1, run)
    return np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*qs.shape[:-3], -1)


def _small(blocks: U8, qtype: int) -> tuple[npt.NDArray[np.generic], F32, F32]:
    """The 32-value types: d (and m) first, then the values."""
    d = _f16(blocks, 0)
    if qtype == Q8_0:
        return np.ascontiguousarray(blocks[..., 2:]).view(np.int8), d, np.zeros_like(d)
    has_min = qtype in (Q4_1, Q5_1)
    start = 4 if has_min else 2
    if qtype in (Q5_0, Q5_1):  # 32 high bits, value j's in bit j (little-endian)
        high = np.unpackbits(blocks[..., start : start + 4], axis=-1, bitorder="little")
        start += 4
    q = _nibbles(blocks[..., start:], 16)
    if qtype in (Q5_0, Q5_1):
        q |= high << 4
    offset = _f16(blocks, 2) if has_min else -(8 if qtype == Q4_0 else 16) * d
    return q, d, offset


def _k_quant(blocks: U8, qtype: int) -> tuple[U8, F32, F32]:
    """Q4_K/Q5_K super-blocks -> values [rows, supers, 256], scale and offset per 32."""
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    sc, m = _scale_min(blocks[..., 4:16])
    if qtype == Q4_K:
        q = _nibbles(blocks[..., 16:], 32)
    else:  # 32 bytes of high bits: bit i of byte j is value 32·i + j's
        high = blocks[..., 16:48]
        q = _nibbles(blocks[..., 48:], 32)
        shifts = np.arange(8, dtype=np.uint8)[:, None]
        q |= (((high[..., None, :] >> shifts) & 1) << 4).reshape(q.shape)
    return q, d * sc, -(dmin * m)


def _scale_min(packed: U8) -> tuple[F32, F32]:
    """The 12 bytes of eight 6-bit scales and mins -> float32 [..., 8] each (gguf's layout:
    bytes 0-3 low 6 bits of sc 0-3, 4-7 of m 0-3, 8-11 low nibbles of sc 4-7 and high
    nibbles of m 4-7, the top 2 bits of sc/m 4-7 in the top of bytes 0-7)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 2) & 48)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 2) & 48)], axis=-1)
    return sc.astype(np.float32), m.astype(np.float32)


def unpack_q6_k(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K rows uint8 [rows, row_bytes] -> q int8 [rows, columns] (-32..31) and scales
    float32 [rows, columns / 16] (d·sc, exact), with w = q·scale per 16 values."""
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw.numpy()).reshape(rows, -1, BLOCK_BYTES[Q6_K])
    # per 128 values: 64 bytes of low nibbles (values 0-63 low, 64-127 high), 32 bytes of
    # 2-bit highs (value 32·i + j in bits 2i of byte j)
    low = _nibbles(blocks[..., :128], 64)  # [rows, supers, 256]
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]
    high = ((high >> shifts) & 3).reshape(low.shape)
    q = ((low | (high << 4)).view(np.int8) - np.int8(32)).reshape(rows, -1)
    sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8).astype(np.float32)
    scales = (_f16(blocks, 208)[..., None] * sc).reshape(rows, -1)
    return torch.from_numpy(q), torch.from_numpy(scales)


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantised rows uint8 [rows, row_bytes] (any type here) -> [rows, columns] in `dtype`."""
    rows = raw.shape[0]
    if qtype == Q6_K:
        q6, scales = unpack_q6_k(raw)
        w = q6.view(rows, -1, 16).float().mul_(scales[..., None])
    elif qtype in SYMMETRIC:  # d·(q - z), as gguf computes it: the same signed zeros
        q, scale, _ = unpack(raw, qtype)
        w = q.float().sub_(SYMMETRIC[qtype]).mul_(scale[..., None])
    else:
        q, scale, offset = unpack(raw, qtype)
        w = q.float().mul_(scale[..., None]).add_(offset[..., None])
    return w.reshape(rows, -1).to(dtype)


# -- quantising (the lm_head's bulk product: lossy, its top logits are recomputed exactly) -----


def quantize_q4_1(weight: F32) -> U8:
    """float32 [rows, columns] -> Q4_1 rows: per 32 values d = (max - min)/15, m = min (f16)."""
    groups = weight.reshape(weight.shape[0], -1, BLOCK)
    low = groups.min(-1, keepdims=True).astype(np.float16)
    scale = ((groups.max(-1, keepdims=True) - low) / 15).astype(np.float16)
    q = _levels(groups - low.astype(np.float32), scale.astype(np.float32))
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    blocks = np.concatenate([scale.view(np.uint8), low.view(np.uint8), nibbles], axis=-1)
    return np.ascontiguousarray(blocks).reshape(weight.shape[0], -1)


def quantize_q4_k(weight: F32) -> U8:
    """float32 [rows, columns] (columns a multiple of 256) -> Q4_K rows: per 32 values an
    offset (-min, min capped at 0) and a scale as 6 bits of the super-block's f16 dmin and d,
    rounded up so that the 16 levels cover the 32 values: 4.5 bits a value."""
    rows = weight.shape[0]
    groups = weight.reshape(rows, -1, 8, BLOCK)  # [rows, supers, sub-blocks, 32]
    offset = -np.minimum(groups.min(-1), 0)
    dmin = _f16_above(offset.max(-1) / 63)
    m = _levels(offset, dmin[..., None], 63, np.ceil)
    base = dmin[..., None] * m  # ≥ the offset: every value + base ≥ 0
    scale = (groups.max(-1) + base) / 15
    d = _f16_above(scale.max(-1) / 63)
    sc = _levels(scale, d[..., None], 63, np.ceil)
    q = _levels(groups + base[..., None], (d[..., None] * sc)[..., None])
    packed = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),  # the layout _scale_min reads
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    nibbles = q[:, :, 0::2] | (q[:, :, 1::2] << 4)  # 64 values: 32 low nibbles, 32 high
    halves = [x.astype(np.float16)[..., None].view(np.uint8) for x in (d, dmin)]
    blocks = np.concatenate([*halves, packed, nibbles.reshape(rows, -1, 128)], axis=-1)
    return np.ascontiguousarray(blocks).reshape(rows, -1)


def _f16_above(values: F32) -> F32:
    """The least f16 at or above each value, as float32."""
    rounded = values.astype(np.float16)
    below = rounded.astype(np.float32) < values
    return np.where(below, np.nextafter(rounded, np.float16(np.inf)), rounded).astype(np.float32)


def _levels(values: F32, step: F32, top: int = 15, rounding: Any = np.rint) -> U8:
    """rounding(values / step) in 0..top (0 where the step is 0)."""
    safe = np.where(step == 0, np.float32(1), step)
    levels: U8 = np.clip(rounding(values / safe), 0, top).astype(np.uint8)
    return levels
