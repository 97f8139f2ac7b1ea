"""GGUF weights as torch modules: the kinds of layer a weight becomes, and every layout's
class and block type under one name for the model's builders and steps.

Where the GGML kernels run and hold a type, GGMLLinear keeps the file's blocks as they are
(engine/weights/ggml_linear.py); otherwise the weights are repacked for torch's int4 kernel
(Int4Linear, Q6KLinear: engine/weights/int4_linear.py) or dequantised to bf16 (DenseLinear).
RowReader reads a stored tensor's rows back (engine/weights/rows.py). A weight fused from parts
of different layouts is a PartsLinear.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.gguf.blocks import (  # the block layouts, re-exported for the kernels' callers
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
    dequantize,
    unpack,
)
from engine.weights.ggml_linear import GGML_DENSE_ROWS, GGMLLinear, dense_rows
from engine.weights.int4_linear import (
    DENSE_ROWS,
    PLAIN,
    SPLIT,
    DenseLinear,
    Int4Linear,
    Q6KLinear,
    interleave_q6,
    kernel_block_rows,
    pack_int4,
)
from engine.weights.rows import RowReader, dense

__all__ = [
    "BLOCK",
    "BLOCK_BYTES",
    "DENSE_ROWS",
    "GGML_DENSE_ROWS",
    "PLAIN",
    "Q4_0",
    "Q4_1",
    "Q4_K",
    "Q5_0",
    "Q5_1",
    "Q5_K",
    "Q6_K",
    "Q8_0",
    "SPLIT",
    "DenseLinear",
    "GGMLLinear",
    "Int4Linear",
    "Linear",
    "Part",
    "PartsLinear",
    "Q6KLinear",
    "RowReader",
    "dense",
    "dense_rows",
    "dequantize",
    "interleave_q6",
    "kernel_block_rows",
    "pack_int4",
    "unpack",
]

# A weight, or a run of fused weights, of one layout.
Part = Int4Linear | DenseLinear | Q6KLinear | GGMLLinear


class PartsLinear(torch.nn.Module):
    """Fused weights (q/k/v, gate/up) whose parts have different layouts: each run of parts of
    one layout is one product, and the outputs are concatenated in the parts' order."""

    def __init__(self, parts: Sequence[Part]) -> None:
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.out_features = sum(p.out_features for p in parts)
        self.in_features = parts[0].in_features

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.linears())

    def linears(self) -> list[Part]:
        return list(self.parts)  # type: ignore[arg-type]  # ModuleList's items are Modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.forward(x) for part in self.linears()], dim=-1)


# The kinds of layer a GGUF weight becomes: all map x [..., in] -> [..., out].
Linear = Part | PartsLinear
