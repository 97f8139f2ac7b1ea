"""GGUF weight blocks as torch tensors, and the CPU kernels that multiply them without unpacking.

GGML quantises a weight row in blocks of 32 values:
    Q4_0  [d: f16][16 bytes: 32 nibbles]            w = d·(q - 8)
    Q4_1  [d: f16][m: f16][16 bytes: 32 nibbles]    w = d·q + m
    Q8_0  [d: f16][32 bytes: int8]                  w = d·q
(nibble j of a block holds value j in its low half and value j + 16 in its high half).

torch's CPU kernel `_weight_int4pack_mm_for_cpu` computes with w = (q - 8)·scale + zero per
group of 32, so Q4_0 is scale = d, zero = 0 and Q4_1 is scale = d, zero = m + 8·d: the same
numbers, repacked, not requantised. Q8_0 has a scale per block too, which the int8 kernel
(one scale per row) cannot hold, so it also goes through the int4 kernel, split exactly into
two nibbles per value: q + 128 = 16·hi + lo gives w = d·q = (hi - 8)·16d + (lo - 8)·d + 8·d,
two int4 weights over the same blocks, run as one matmul over twice the rows.
Scales are kept in the activation dtype (bf16), the only dtype these kernels are fast in;
the kernels also round their output to bf16 (see llama.Head for what that means for logits).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

BLOCK = 32
Q4_0, Q4_1, Q8_0 = 2, 3, 8  # ggml type ids
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q8_0: 34}
# Bit work is done in numpy: torch's uint8 shifts and byte transposes run 10x slower here.


def unpack(raw: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The integers, scales and offsets of quantised rows: w = q·scale + offset per block.

    raw uint8 [rows, row_bytes] -> q [rows, blocks, 32] (uint8 0..15 or int8), scale and
    offset [rows, blocks] (float32).
    """
    rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw.numpy()).reshape(rows, -1, BLOCK_BYTES[qtype])
    halves = blocks.view(np.float16)  # every block starts with f16 d (Q4_1: then f16 m)
    d = torch.from_numpy(halves[..., 0].astype(np.float32))
    words: npt.NDArray[np.unsignedinteger[Any]]  # 32- or 16-bit words, as the type packs them
    mask: np.unsignedinteger[Any]
    if qtype == Q8_0:
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return torch.from_numpy(q), d, torch.zeros_like(d)
    if qtype == Q4_1:
        offset = torch.from_numpy(halves[..., 1].astype(np.float32))
        words = blocks.view(np.uint32)[..., 1:]  # 20-byte blocks: 4 words of nibbles
        mask = np.uint32(0x0F0F0F0F)
    elif qtype == Q4_0:
        offset = -8 * d
        words = halves.view(np.uint16)[..., 1:]  # 18-byte blocks: 8 half-words of nibbles
        mask = np.uint16(0x0F0F)
    else:
        raise ValueError(f"ggml type {qtype} is not a 32-value block type")
    # nibble j of a block holds value j (low half) and value j + 16 (high half)
    q = np.concatenate([words & mask, (words >> 4) & mask], axis=-1).view(np.uint8)
    return torch.from_numpy(q), d, offset


def dequantize(raw: torch.Tensor, qtype: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Quantised rows uint8 [rows, row_bytes] -> [rows, columns] in `dtype`."""
    q, scale, offset = unpack(raw, qtype)
    w = q.float() * scale[..., None] + offset[..., None]
    return w.reshape(raw.shape[0], -1).to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> the CPU int4 kernel's packed layout [N, K/2].

    The layout (read off `_convert_weight_to_int4pack_for_cpu`): per block of 64 rows, for
    each k, 32 bytes holding row j in the low nibble and row j + 32 in the high one. Built
    here with numpy, ~8x faster than widening to int32 for the op; the op handles other N.
    """
    rows, columns = q.shape
    if rows % 64:
        packed_by_op: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        return packed_by_op
    halves = q.numpy().reshape(rows // 64, 2, 32, columns)
    packed = halves[:, 0] | (halves[:, 1] << 4)  # [N/64, 32, K]
    packed = np.ascontiguousarray(packed.transpose(0, 2, 1)).reshape(rows, columns // 2)
    return torch.from_numpy(packed)


# From this many rows of activations (a prefill), unpacking the weights to bf16 for one dense
# matmul (AMX/AVX-512 bf16 here) beats the int4 kernel, whose cost grows with the rows. One
# layer's four weights, one thread: 64 rows 9.4 ms either way, 128 rows 18.5 ms int4 against
# 11.1 ms unpacked, 16 rows 2.6 against 10.6.
DENSE_ROWS = 64


_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # the overload: no dispatch by args


class Int4Linear(torch.nn.Module):
    """y = x·Wᵀ with W held as packed nibbles and a scale and zero per group of 32.

    Built exactly from Q4_0/Q4_1 rows, or from Q8_0 rows as two halves (module docstring).
    """

    packed: torch.Tensor  # buffers, declared for the type checker
    scales_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)  # [rows, K/2] uint8
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)  # [K/32, rows, 2]
        self.out_features = out_features  # half the packed rows for a split Q8_0 weight
        self.in_features = scales_zeros.shape[0] * BLOCK
        self.plain = packed.shape[0] == out_features  # one product, not two halves to add

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, qtype: int, dtype: torch.dtype) -> Int4Linear:
        rows = raw.shape[0]
        q, scale, offset = unpack(raw, qtype)
        if qtype == Q8_0:  # two nibble halves: hi with scale 16·d, lo with scale d
            biased = (q.int() + 128).to(torch.uint8)
            q = torch.cat([biased >> 4, biased & 15])
            scale = torch.cat([16 * scale, scale])
            offset = torch.cat([-128 * scale[rows:], torch.zeros_like(offset)])
        zero = offset + 8 * scale  # the kernel computes (q - 8)·scale + zero
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(pack_int4(q.reshape(q.shape[0], -1).contiguous()), scales_zeros, rows)

    @classmethod
    def requantized(cls, weight: torch.Tensor, dtype: torch.dtype) -> Int4Linear:
        """float weights [N, K] quantised to 4 bits, min to max per group of 32 (lossy)."""
        rows = weight.shape[0]
        groups = weight.float().reshape(rows, -1, BLOCK)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
        zero = low + 8 * scale
        scales_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        return cls(pack_int4(q.to(torch.uint8).reshape(rows, -1)), scales_zeros, rows)

    def dense(self) -> torch.Tensor:
        """The weights [out, in] in the activation dtype (a transposed view of dense_t)."""
        return self.dense_t().t()

    def dense_t(self) -> torch.Tensor:
        """The weights transposed, [in, out] in the activation dtype, unpacked for a large
        matmul (rows a multiple of 64).

        [in, out] is the layout oneDNN multiplies without reordering (x @ Wᵀ measured 1.5x
        faster than linear(x, W) here), and the one the packing unpacks to in runs of 32
        bytes: packed [N/64, K, 32] holds rows j and j + 32 of each 64 in the two nibbles.
        Every pass is a torch op, so a prefill's unpacking runs on all torch's threads.
        """
        rows, columns = self.packed.shape[0], self.packed.shape[1] * 2
        packed = self.packed.view(rows // 64, columns, 32).transpose(0, 1)  # [K, N/64, 32]
        weight = torch.empty(columns, rows // 64, 2, 32, dtype=self.scales_zeros.dtype)
        weight[:, :, 0].copy_(packed & 15)
        weight[:, :, 1].copy_(packed >> 4)
        weight = weight.view(columns // BLOCK, BLOCK, rows)
        # (q - 8)·scale + zero as q·scale + (zero - 8·scale), with contiguous operands: a
        # strided scale sends mul_ down a path 5x slower (addcmul's broadcast measured 2x)
        scale = self.scales_zeros[..., 0].contiguous()  # [K/32, N]
        offset = self.scales_zeros[..., 1] - 8 * scale
        weight.mul_(scale[:, None]).add_(offset[:, None])
        weight = weight.view(columns, rows)
        if not self.plain:  # the two halves of a split Q8_0 weight
            weight = weight[:, : self.out_features] + weight[:, self.out_features :]
        return weight

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.packed, self.scales_zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in the scales' dtype. A decode step calls this 121 times
        with [1, in] bf16, so that case runs the kernel and nothing else (~2.5 µs a call less
        than the general path's checks)."""
        scales_zeros = self.scales_zeros
        if self.plain and x.dtype is scales_zeros.dtype and x.dim() == 2 and x.shape[0] == 1:
            product: torch.Tensor = _int4_mm(x, self.packed, BLOCK, scales_zeros)
            return product
        shape = x.shape
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
        if x.dtype != scales_zeros.dtype:
            x = x.to(scales_zeros.dtype)
        if x.shape[0] >= DENSE_ROWS and self.packed.shape[0] % 64 == 0:
            y = torch.mm(x, self.dense_t())
        else:
            y = _int4_mm(x, self.packed, BLOCK, scales_zeros)
        if not self.plain:  # the two halves of a split Q8_0 weight
            y = y[:, : self.out_features] + y[:, self.out_features :]
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.out_features)


class DenseLinear(torch.nn.Module):
    """A weight GGUF stores in a type without a CPU kernel here, dequantised to `dtype`."""

    weight: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight, persistent=False)  # [out, in]
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x.to(self.weight.dtype), self.weight)


# The two kinds of layer a GGUF weight becomes: both map x [..., in] -> [..., out].
Linear = Int4Linear | DenseLinear


def fuse(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate the rows of several raw weights of one type (q, k, v -> qkv)."""
    return torch.cat(parts, dim=0)


F32, F16, BF16 = 0, 1, 30


class RowReader:
    """Rows of a stored tensor (uint8 [rows, row_bytes], any GGUF type) by index, in float32.

    The embedding reads a row a token and the lm_head 64 a step (llama.Head). Q8_0 rows are
    read through strided views of their int8 values and f16 scales: four ops, where unpacking
    through numpy takes a dozen.
    """

    def __init__(self, raw: torch.Tensor, qtype: int, columns: int) -> None:
        self.raw, self.qtype, self.columns = raw, qtype, columns
        if qtype == Q8_0:
            blocks = raw.view(raw.shape[0], -1, BLOCK_BYTES[Q8_0])
            self._scales = blocks[..., :2].view(torch.float16)  # [rows, blocks, 1]
            self._values = blocks[..., 2:].view(torch.int8)  # [rows, blocks, 32]

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        """index [n] (int64) -> float32 [n, columns]."""
        if self.qtype == Q8_0:
            weights = self._values[index].float().mul_(self._scales[index])
            return weights.view(-1, self.columns)
        return dense(self.raw[index], self.qtype, self.columns)

    def all(self) -> torch.Tensor:
        """Every row, in float32 [rows, columns]."""
        return dense(self.raw, self.qtype, self.columns)


def dense(raw: torch.Tensor, qtype: int, columns: int) -> torch.Tensor:
    """Any GGUF tensor type as float32 rows [rows, columns] (K-quants through the gguf package)."""
    rows = raw.shape[0]
    if qtype == F32:
        return raw.contiguous().view(torch.float32).reshape(rows, columns)
    if qtype == F16:
        return raw.contiguous().view(torch.float16).reshape(rows, columns).float()
    if qtype == BF16:
        return raw.contiguous().view(torch.bfloat16).reshape(rows, columns).float()
    if qtype in BLOCK_BYTES:
        return dequantize(raw, qtype)
    from gguf import GGMLQuantizationType, quants  # numpy reference for the other block types

    values = quants.dequantize(raw.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(values.reshape(rows, columns).astype("float32", copy=False))
