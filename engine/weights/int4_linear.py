"""GGUF weights repacked for torch's CPU int4 kernel, multiplied without unpacking.

Where the GGML kernels do not hold a type (Q5_K), or do not run, a weight is repacked here.
The block layouts (engine/gguf/blocks.py) decode as w = q·scale + offset per group of 32.
torch's CPU kernel `_weight_int4pack_mm_for_cpu` computes with w = (q - 8)·scale + zero per
group of 32, so a 4-bit type (Q4_0, Q4_1, Q4_K) is scale = scale, zero = offset + 8·scale: the
same numbers, repacked, not requantised. A wider type (Q5_0, Q5_1, Q5_K, Q8_0, biased to
unsigned) goes through the same kernel split exactly into two nibbles per value:
q = 16·hi + lo gives w = hi·16·scale + lo·scale + offset, two int4 weights over the same
groups, run as one matmul over twice the rows. Q6_K's scales cover 16 values, finer than the
kernel's smallest group: Q6KLinear holds it exactly in the same kernel, each 16 values as a
group of 32 nibbles multiplied by the activations laid out alike, where the AVX-512 kernels
run, and dequantised to bf16 elsewhere (see fast_builder._layout). Scales are kept in the
activation dtype (bf16), the only dtype these kernels are fast in; the kernels also round their
output to bf16 (see llama.Head for what that means for logits).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import numpy as np
import numpy.typing as npt
import torch

from engine.gguf.blocks import BITS, BLOCK, GROUPED, SYMMETRIC, unpack, unpack_q6_k

# The types the int4 kernel holds exactly: 4-bit ones as they are (plain), 5- and 8-bit ones
# as two nibble halves.
PLAIN = tuple(t for t in GROUPED if BITS[t] == 4)
SPLIT = tuple(t for t in GROUPED if BITS[t] > 4)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> the CPU int4 kernel's packed layout [N, K/2].

    The layout (read off `_convert_weight_to_int4pack_for_cpu`) depends on the kernel set torch
    runs: per block of B rows (64 with AVX-512, 32 with AVX2), for each k, B/2 bytes holding
    row j in the low nibble and row j + B/2 in the high one. Built here with numpy, much faster
    than widening to int32 for the op; the op handles other N and other kernel sets.
    """
    rows = q.shape[0]
    block = kernel_block_rows()
    if block is None or rows % block:
        packed_by_op: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1)
        return packed_by_op
    return torch.from_numpy(_pack_blocks(q.numpy(), block))


def _pack_blocks(q: npt.NDArray[np.uint8], block: int) -> npt.NDArray[np.uint8]:
    rows, columns = q.shape
    halves = q.reshape(rows // block, 2, block // 2, columns)
    packed = halves[:, 0] | (halves[:, 1] << 4)  # [N/B, B/2, K]
    return np.ascontiguousarray(packed.transpose(0, 2, 1)).reshape(rows, columns // 2)


@functools.cache
def kernel_block_rows() -> int | None:
    """Rows per block of the int4 kernel's packed layout in this process (64 or 32), found by
    packing a probe with torch's op; None for a layout not known here (the op packs those,
    and prefills run the int4 kernel instead of unpacking to bf16). The packed bytes differ
    between kernel sets: a weight packed under AVX-512 multiplies to garbage under AVX2."""
    probe = np.random.default_rng(0).integers(0, 16, (64, 64), dtype=np.uint8)
    by_op = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(probe).int(), 1)
    for block in (64, 32):
        if np.array_equal(_pack_blocks(probe, block), by_op.numpy()):
            return block
    return None


Form = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # nibbles, scales, zeros of some rows


def _int4_form(raw: torch.Tensor, qtype: int) -> Form:
    """Rows in the kernel's terms: nibbles [R, groups, 32], scale and zero [R, groups] with
    w = (q - 8)·scale + zero; R = rows, or 2·rows (hi rows, then lo rows) for a SPLIT type."""
    q, scale, offset = unpack(raw, qtype)
    if qtype in SPLIT:
        return _halves(q.numpy(), qtype, scale, offset)
    if qtype not in PLAIN:
        raise ValueError(f"ggml type {qtype} has no exact int4 form")
    return q, scale, offset + 8 * scale


def _half(form: Form, half: int) -> Form:
    """The hi (0) or lo (1) rows of a split weight's form."""
    rows = form[0].shape[0] // 2
    q, scale, zero = (t[half * rows : (half + 1) * rows] for t in form)
    return q, scale, zero


def _halves(
    q: npt.NDArray[np.generic], qtype: int, scale: torch.Tensor, offset: torch.Tensor
) -> Form:
    """5- or 8-bit values as [hi rows; lo rows] of nibbles with the kernel's scale and zero.

    The zeros are chosen to round well in bf16: a type with w = d·(q - z) (Q5_0, Q8_0) is
    biased to u = q - z + 128, so w = (hi - 8)·16d + (lo - 8)·d + 8d, zeros 0 and 8d; the
    others (w = q·scale + offset, q < 32) store hi + 8, so the high half's zero is the offset.
    """
    if qtype in SYMMETRIC:
        unsigned = (q.astype(np.int16) + (128 - SYMMETRIC[qtype])).astype(np.uint8)
        hi, high_zero = unsigned >> 4, torch.zeros_like(offset)
    else:
        unsigned = q.astype(np.uint8, copy=False)
        hi, high_zero = (unsigned >> 4) + np.uint8(8), offset
    nibbles = torch.from_numpy(np.concatenate([hi, unsigned & np.uint8(15)]))
    return nibbles, torch.cat([16 * scale, scale]), torch.cat([high_zero, 8 * scale])


# From this many rows of activations (a prefill), unpacking the weights to bf16 for one dense
# matmul (AMX/AVX-512 bf16 where the CPU has them) beats the int4 kernel, whose cost grows
# with the rows; below it, unpacking costs more than it saves.
DENSE_ROWS = 64


_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # the overload: no dispatch by args


class Int4Linear(torch.nn.Module):
    """y = x·Wᵀ with W held as packed nibbles and a scale and zero per group of 32.

    Built exactly from PLAIN rows, or from SPLIT rows as two halves (module docstring).
    """

    packed: torch.Tensor  # buffers, declared for the type checker
    scales_zeros: torch.Tensor

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, out_features: int):
        super().__init__()
        self.register_buffer("packed", packed, persistent=False)  # [rows, K/2] uint8
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)  # [K/32, rows, 2]
        self.out_features = out_features  # half the packed rows for a split weight
        self.in_features = scales_zeros.shape[0] * BLOCK
        self.plain = packed.shape[0] == out_features  # one product, not two halves to add

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, qtype: int, dtype: torch.dtype) -> Int4Linear:
        """Rows of a type in PLAIN (one product) or SPLIT (two halves), exactly."""
        return cls.from_parts([(raw, qtype)], dtype)

    @classmethod
    def from_parts(
        cls, parts: Sequence[tuple[torch.Tensor, int]], dtype: torch.dtype
    ) -> Int4Linear:
        """The rows of several raw weights, all PLAIN or all SPLIT types, as one linear (q, k
        and v fused). Joined before packing: the packed layout interleaves blocks of 64 rows."""
        if len({qtype in SPLIT for _, qtype in parts}) != 1:
            raise ValueError("plain and split types cannot share one product")
        forms = [_int4_form(raw, qtype) for raw, qtype in parts]
        if parts[0][1] in SPLIT:  # every part's hi rows, then every part's lo rows
            forms = [_half(f, 0) for f in forms] + [_half(f, 1) for f in forms]
        q, scale, zero = (torch.cat([form[i] for form in forms]) for i in range(3))
        rows = sum(raw.shape[0] for raw, _ in parts)
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
        matmul (rows a multiple of the layout's block, `kernel_block_rows()`).

        [in, out] is the layout oneDNN multiplies without reordering (x @ Wᵀ is faster than
        linear(x, W)), and the one the packing unpacks to in runs of 32
        bytes: packed [N/B, K, B/2] holds rows j and j + B/2 of each B in the two nibbles.
        Every pass is a torch op, so a prefill's unpacking runs on all torch's threads.
        """
        rows, columns = self.packed.shape[0], self.packed.shape[1] * 2
        if not self.unpackable:  # a layout not read here: the kernel's own product with I
            eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype)
            product: torch.Tensor = _int4_mm(eye, self.packed, BLOCK, self.scales_zeros)
            halves = product[:, : self.out_features], product[:, self.out_features :]
            return product if self.plain else halves[0] + halves[1]
        weight = self.nibbles_t().view(columns // BLOCK, BLOCK, rows)
        # (q - 8)·scale + zero, with contiguous operands: a strided scale sends mul_ down a
        # much slower path (and addcmul's broadcast is slower too). Not q·scale + (zero - 8·scale):
        # the high half of a 5-bit weight would lose ~1% in bf16 to the cancellation.
        scale = self.scales_zeros[..., 0].contiguous()  # [K/32, N]
        zero = self.scales_zeros[..., 1].contiguous()
        weight.sub_(8).mul_(scale[:, None]).add_(zero[:, None])
        weight = weight.view(columns, rows)
        if not self.plain:  # the two halves of a split weight
            weight = weight[:, : self.out_features] + weight[:, self.out_features :]
        return weight

    def nibbles_t(self) -> torch.Tensor:
        """The packed nibbles 0..15 as numbers [in, rows] in the activation dtype (rows: the
        packed rows, a multiple of the layout's block)."""
        rows, columns = self.packed.shape[0], self.packed.shape[1] * 2
        block = cast(int, kernel_block_rows())
        packed = self.packed.view(rows // block, columns, block // 2).transpose(0, 1)
        nibbles = torch.empty(columns, rows // block, 2, block // 2, dtype=self.scales_zeros.dtype)
        nibbles[:, :, 0].copy_(packed & 15)
        nibbles[:, :, 1].copy_(packed >> 4)
        return nibbles.view(columns, rows)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.packed, self.scales_zeros))

    @property
    def unpackable(self) -> bool:
        """Whether dense_t can read the packed layout (whole blocks of a known layout)."""
        block = kernel_block_rows()
        return block is not None and self.packed.shape[0] % block == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in the scales' dtype. A decode step calls this 121 times
        with [1, in] bf16, so that case runs the kernel and nothing else, skipping the general
        path's checks."""
        scales_zeros = self.scales_zeros
        if self.plain and x.dtype is scales_zeros.dtype and x.dim() == 2 and x.shape[0] == 1:
            product: torch.Tensor = _int4_mm(x, self.packed, BLOCK, scales_zeros)
            return product
        shape = x.shape
        if x.dim() != 2:
            x = x.reshape(-1, shape[-1])
        if x.dtype != scales_zeros.dtype:
            x = x.to(scales_zeros.dtype)
        if x.shape[0] >= DENSE_ROWS and self.unpackable:
            y = torch.mm(x, self.dense_t())  # the halves of a split weight added already
        else:
            y = _int4_mm(x, self.packed, BLOCK, scales_zeros)
            if not self.plain:  # the two halves of a split weight
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


Q6_GROUP = 16  # values a Q6_K scale covers


class Q6KLinear(torch.nn.Module):
    """A Q6_K weight exactly in the int4 kernel, its scale per 16 values kept.

    A Q6_K value is w = s·(q - 32), q = 16·hi + lo (hi 0..3), s per 16 values: finer than the
    kernel's smallest group (32). So each 16 values become one group of 32 nibbles, their lo
    then 2·hi + 5, multiplied by the activations laid out alike, x then 8·x:
        s·(lo - 8)·x + s·(2·hi + 5 - 8)·8x = s·(lo + 16·hi - 32)·x,
    zero 0 and scale s: exact, with the scale in bf16 as every int4 weight here (8·x is exact
    in bf16). 1.25 bytes a weight (bf16: 2, the file: 0.82). A one-row product beats a bf16
    copy under AVX-512 and loses to it under AVX2 (its int4 kernel is bound by unpacking), so
    build_fast uses this layout only where the AVX-512 kernels run (fast_builder._layout).
    """

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor) -> None:
        """packed [out, in] (2·in nibbles), scales_zeros [in/16, out, 2]."""
        super().__init__()
        self.out_features, self.in_features = packed.shape
        self.interleaved = Int4Linear(packed, scales_zeros, self.out_features)  # over x, 8·x

    @property
    def packed(self) -> torch.Tensor:
        return self.interleaved.packed

    @property
    def scales_zeros(self) -> torch.Tensor:
        return self.interleaved.scales_zeros

    @classmethod
    def from_blocks(cls, raw: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> Q6KLinear:
        """Q6_K rows uint8 [rows, row_bytes] (rows a multiple of 16, the kernel's rule)."""
        q, scales = unpack_q6_k(raw)  # int8 q - 32 [out, in], float32 s [out, in/16]
        rows = q.shape[0]
        unsigned = (q.view(rows, -1, Q6_GROUP).to(torch.int16) + 32).to(torch.uint8)
        nibbles = torch.cat([unsigned & 15, 2 * (unsigned >> 4) + 5], dim=-1).view(rows, -1)
        scales_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1)
        return cls(pack_int4(nibbles), scales_zeros.transpose(0, 1).contiguous().to(dtype))

    @property
    def nbytes(self) -> int:
        return self.interleaved.nbytes

    def dense_t(self) -> torch.Tensor:
        """The weights transposed, [in, out], in the activation dtype (for a prefill)."""
        if not self.interleaved.unpackable:  # the product with I: lo's column + 8·m's
            both = self.interleaved.dense_t().view(-1, 2, Q6_GROUP, self.out_features)
            return (both[:, 0] + 8 * both[:, 1]).view(self.in_features, self.out_features)
        # q - 32 = (lo - 8) + 8·(m - 8), an integer (exact in bf16), times s: one rounding
        nibbles = self.interleaved.nibbles_t().view(-1, 2, Q6_GROUP, self.out_features)
        weight = nibbles[:, 1].mul(8).add_(nibbles[:, 0]).sub_(72)  # [in/16, 16, out]
        scale = self.scales_zeros[..., 0].contiguous()  # [in/16, out]
        return weight.mul_(scale[:, None]).view(self.in_features, self.out_features)

    def dense(self) -> torch.Tensor:
        return self.dense_t().t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in the scales' dtype."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).to(self.scales_zeros.dtype)
        if x.shape[0] >= DENSE_ROWS and self.interleaved.unpackable:
            y = torch.mm(x, self.dense_t())
        else:
            y = self.interleaved.forward(interleave_q6(x))
        return y.reshape(*shape[:-1], self.out_features)


def interleave_q6(x: torch.Tensor) -> torch.Tensor:
    """Activations [n, in] -> [n, 2·in] laid out as Q6KLinear's nibbles: per 16, x then 8·x."""
    groups = x.view(x.shape[0], -1, Q6_GROUP)
    return torch.cat([groups, groups * 8], dim=-1).view(x.shape[0], -1)
