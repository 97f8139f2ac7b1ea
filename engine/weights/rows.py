"""Rows of a stored GGUF tensor read back as float32: a few by index (the embedding's lookups,
the lm_head's exact top logits) or all of them (a reference's dequantised weights)."""

from __future__ import annotations

import torch

from engine.gguf.blocks import BLOCK_BYTES, Q8_0, dequantize
from engine.weights import ggml_kernel

F32, F16, BF16 = 0, 1, 30


class RowReader:
    """Rows of a stored tensor (uint8 [rows, row_bytes], any GGUF type) by index, in float32.

    The embedding reads a row a token and the lm_head 64 a step (llama.Head). Where the GGML
    kernels load, the rows of every type they read are their `ggml_rows` (one call). Elsewhere
    Q8_0 rows are read through strided views of their int8 values and f16 scales: four ops,
    where unpacking through numpy takes a dozen. The other block types go through ggml_blocks' numpy
    unpack, faster than gguf's dequantize and than a torch version of the same bit work.
    """

    def __init__(self, raw: torch.Tensor, qtype: int, columns: int) -> None:
        self.raw, self.qtype, self.columns = raw, qtype, columns
        if qtype == Q8_0:
            blocks = raw.view(raw.shape[0], -1, BLOCK_BYTES[Q8_0])
            self._scales = blocks[..., :2].view(torch.float16)  # [rows, blocks, 1]
            self._values = blocks[..., 2:].view(torch.int8)  # [rows, blocks, 32]

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        """index [n] (int64) -> float32 [n, columns]."""
        if self.in_kernels and index.device.type == "cpu":
            rows: torch.Tensor = torch.ops.glassbox.ggml_rows(
                self.raw, index, self.qtype, self.columns
            )
            return rows
        if self.qtype == Q8_0:
            weights = self._values[index].float().mul_(self._scales[index])
            return weights.view(-1, self.columns)
        return dense(self.raw[index], self.qtype, self.columns)

    @property
    def in_kernels(self) -> bool:
        """Whether the GGML kernels read these rows (one call where the torch way is four ops;
        llama.Head's exact_head reads them too)."""
        return (
            self.raw.device.type == "cpu"
            and self.qtype in ggml_kernel.TYPES
            and ggml_kernel.ensure() is None
        )

    def all(self) -> torch.Tensor:
        """Every row, in float32 [rows, columns]."""
        return dense(self.raw, self.qtype, self.columns)


def dense(raw: torch.Tensor, qtype: int, columns: int) -> torch.Tensor:
    """Any GGUF tensor type as float32 rows [rows, columns] (types ggml_blocks does not read,
    such as Q2_K, through the gguf package)."""
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
