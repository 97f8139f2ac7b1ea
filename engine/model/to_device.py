"""The fast model's GGUF weights moved to a GPU: bf16, or CUDA's int4 kernel where asked.

The CPU's kernels (engine/weights/linear.py) do not run on CUDA, so `to_device` rebuilds every
linear for the device: dequantised to bf16 (each value rounded once to bf16), or, with
$GLASSBOX_CUDA_INT4=1, a plain 4-bit weight repacked for `aten._weight_int4pack_mm`, the same
nibbles, scales and zeros in CUDA's tiled layout (w = (q - 8)·scale + zero per group of 32,
as on the CPU). For bf16 the model is built with the file's own blocks (fast_builder's
`device_blocks`): they cross to the device as stored and engine/gguf/torch_blocks.py
dequantises them there, so nothing is repacked or dequantised on the host. The embedding
and the lm_head's exact rows become one float32 table on the device, so a token's row is
read there without a host round trip. The log says which form each model got.

Waits for a GPU: `pack_int4_cuda` calls `_convert_weight_to_int4pack`, a CUDA-only op, so it
and Int4CudaLinear are tested only where CUDA is present; whether int4 pays at batch 1 for
these shapes is unmeasured, which is why bf16 is the default. The bf16 form is what the CPU
tests exercise (`to_device(model, cpu)`).
"""

from __future__ import annotations

import logging
import os

import torch

from engine.gguf import blocks, torch_blocks
from engine.gguf.blocks import BLOCK_BYTES
from engine.model.layer import rope_matrix_rows
from engine.model.llama import Block, GGUFLlama
from engine.weights.ggml_linear import GGMLLinear
from engine.weights.linear import BLOCK, DenseLinear, Int4Linear, Linear, Part, PartsLinear
from engine.weights.rows import RowReader

log = logging.getLogger(__name__)

INNER_K_TILES = 2  # CUDA's int4 layout: k tiles per inner loop (2, 4 or 8; K % (16·it) == 0)


class DeviceRows:
    """RowReader's interface over a float32 table [rows, columns] on the device."""

    def __init__(self, table: torch.Tensor) -> None:
        self.raw = table

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        return self.raw[index]

    def all(self) -> torch.Tensor:
        return self.raw


def pack_int4_cuda(q: torch.Tensor, inner_k_tiles: int = INNER_K_TILES) -> torch.Tensor:
    """uint8 values 0..15 [N, K] (on a CUDA device) -> `_weight_int4pack_mm`'s packed weight.
    The op takes two values a byte, the even column in the high nibble."""
    packed: torch.Tensor = torch.ops.aten._convert_weight_to_int4pack(
        pair_nibbles(q), inner_k_tiles
    )
    return packed


def pair_nibbles(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> [N, K/2], column 2j in the high nibble, 2j + 1 low."""
    return (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()


def nibbles(linear: Int4Linear) -> torch.Tensor:
    """A plain Int4Linear's values 0..15 as uint8 [out, in] (from the CPU's packed layout)."""
    return linear.nibbles_t().t().to(torch.uint8).contiguous()


class Int4CudaLinear(torch.nn.Module):
    """y = x·Wᵀ through CUDA's int4 kernel; the scales and zeros as the CPU kernel's."""

    packed: torch.Tensor  # buffers, declared for the type checker
    scales_zeros: torch.Tensor

    def __init__(self, linear: Int4Linear, device: torch.device) -> None:
        super().__init__()
        packed = pack_int4_cuda(nibbles(linear).to(device))
        self.register_buffer("packed", packed, persistent=False)
        self.register_buffer("scales_zeros", linear.scales_zeros.to(device), persistent=False)
        self.out_features, self.in_features = linear.out_features, linear.in_features

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in (self.packed, self.scales_zeros))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(self.scales_zeros.dtype)
        y: torch.Tensor = torch.ops.aten._weight_int4pack_mm(
            flat, self.packed, BLOCK, self.scales_zeros
        )
        return y.reshape(*x.shape[:-1], self.out_features)


def int4_wanted(device: torch.device) -> bool:
    """CUDA's int4 kernel only when asked for: unmeasured whether it pays at these shapes."""
    return device.type == "cuda" and os.environ.get("GLASSBOX_CUDA_INT4") == "1"


def int4_fits(linear: Linear) -> bool:
    """A plain 4-bit weight whose shape CUDA's kernel takes."""
    return (
        isinstance(linear, Int4Linear)
        and linear.plain
        and linear.unpackable
        and linear.in_features % (16 * INNER_K_TILES) == 0
        and linear.out_features % 8 == 0
    )


def device_linear(linear: Linear, device: torch.device, int4: bool) -> torch.nn.Module:
    """One linear in its device form: CUDA int4 where asked and it fits, else bf16."""
    if int4 and int4_fits(linear):
        return Int4CudaLinear(linear, device)  # type: ignore[arg-type]  # int4_fits checked
    parts = linear.linears() if isinstance(linear, PartsLinear) else [linear]
    return DenseLinear(torch.cat([_weight(part, device) for part in parts]))


def _weight(part: Part, device: torch.device) -> torch.Tensor:
    """A part's weights [out, in] in bf16 on `device`: the file's blocks moved there as they
    are and dequantised there, or what the CPU's kernels multiply, moved."""
    if isinstance(part, GGMLLinear):
        return dequantize_on(part.raw, part.qtype, device, torch.bfloat16)
    weight = part.weight if isinstance(part, DenseLinear) else part.dense()
    return weight.to(device, torch.bfloat16)


def _table(rows: RowReader, device: torch.device) -> torch.Tensor:
    """Every row of a stored tensor in float32 on `device` (a block type dequantised there)."""
    if rows.qtype in BLOCK_BYTES:
        return dequantize_on(rows.raw, rows.qtype, device)
    return rows.all().to(device)


def dequantize_on(
    raw: torch.Tensor, qtype: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """A stored tensor's blocks dequantised on `device`: torch's ops on an accelerator, the
    numpy reference on the CPU, where its bit work is several times faster (the same values)."""
    if device.type == "cpu":
        return blocks.dequantize(raw, qtype, dtype)
    return torch_blocks.dequantize(raw.to(device), qtype, dtype)


def to_device(model: GGUFLlama, device: torch.device) -> GGUFLlama:
    """`model` with every weight in its `device` form (in place; returned for chaining)."""
    int4 = int4_wanted(device)
    for module in model.blocks:
        block: Block = module  # type: ignore[assignment]
        attention, feed_forward = block.attention, block.feed_forward
        attention.qkv = device_linear(attention.qkv, device, int4)  # type: ignore[assignment]
        attention.out = device_linear(attention.out, device, int4)  # type: ignore[assignment]
        feed_forward.gate_up = device_linear(feed_forward.gate_up, device, int4)  # type: ignore[assignment]
        feed_forward.down = device_linear(feed_forward.down, device, int4)  # type: ignore[assignment]
    embedding = model.embedding.lookup
    table = DeviceRows(_table(embedding, device))
    head = model.output
    tied = head.lookup.raw.data_ptr() == embedding.raw.data_ptr()  # one mapping of the file
    rows = table if tied else DeviceRows(_table(head.lookup, device))
    head.bulk = device_linear(head.bulk, device, int4)  # type: ignore[assignment]
    head.lookup, head.rows = rows, rows.raw  # type: ignore[assignment]
    model.embedding.lookup, model.embedding.rows = table, table.raw  # type: ignore[assignment]
    model.rope_matrix_rows = min(model.rope_matrix_rows, rope_matrix_rows(device))
    model.to(device)
    log.info("GGUF weights on %s: %s", device, "int4 (CUDA kernel) where 4-bit, else bf16"
             if int4 else "bf16 (CUDA's int4 path waits for a GPU measurement)")  # fmt: skip
    return model
