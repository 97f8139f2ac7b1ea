"""GGUF weights kept as the file's own blocks and multiplied by the GGML kernels
(engine/weights/ggml_kernel.py) with integer dot products, llama.cpp's way."""

from __future__ import annotations

import torch

from engine.gguf.blocks import Q4_1, Q4_K, quantize_q4_1, quantize_q4_k
from engine.weights import ggml_kernel

# From this many rows the GGML kernels' products (each block of weights unpacked for four rows
# at a time, so their cost grows with the rows) lose to dequantising panels of the weights for
# torch's matmuls: bf16 panels where the CPU multiplies bf16, float32 ones (slower) elsewhere.
GGML_DENSE_ROWS = {torch.bfloat16: 16, torch.float32: 32}


def dense_rows() -> int:
    """The rows from which a product takes dequantised panels on this CPU."""
    return GGML_DENSE_ROWS[ggml_kernel.dense_dtype()]


class GGMLLinear(torch.nn.Module):
    """y = x·Wᵀ with W the file's own blocks of one type, multiplied by the GGML kernels
    (engine/weights/ggml_kernel.py: activations rounded to int8 in two terms per block); held at the
    file's size. From `dense_rows()` rows (a prefill) the kernels dequantise the blocks as
    gguf dequantizes them, a cache-sized panel of rows at a time, each multiplied as it is made
    (ggml_dense_mm): no dense copy of the whole tensor is written. The panels are bf16 where the
    CPU has bf16 dot products, else float32 (`ggml_kernel.dense_dtype`)."""

    raw: torch.Tensor  # a buffer, declared for the type checker

    def __init__(
        self, raw: torch.Tensor, qtype: int, in_features: int, part_rows: tuple[int, ...] = ()
    ) -> None:
        """`part_rows`: the rows of each of the file's tensors joined in `raw` (q, k and v),
        each multiplied on its own in a prefill (see `_dense`); empty: one tensor."""
        super().__init__()
        self.register_buffer("raw", raw, persistent=False)  # uint8 [out, row bytes]
        self.qtype, self.in_features, self.out_features = qtype, in_features, raw.shape[0]
        self.part_rows = part_rows if len(part_rows) > 1 else ()

    @classmethod
    def requantized(cls, weight: torch.Tensor, qtype: int = Q4_1) -> GGMLLinear:
        """float weights [N, K] requantised to Q4_1 or Q4_K blocks (lossy: the lm_head's bulk
        product, whose top logits llama.Head recomputes from the file's rows)."""
        quantize = {Q4_1: quantize_q4_1, Q4_K: quantize_q4_k}[qtype]
        raw = torch.from_numpy(quantize(weight.float().numpy()))
        return cls(raw, qtype, weight.shape[1])

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def dense(self) -> torch.Tensor:
        """The weights [out, in] in bf16."""
        weight: torch.Tensor = torch.ops.glassbox.ggml_dequantize(
            self.raw, self.qtype, self.in_features
        )
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> [..., out] in bf16."""
        shape = x.shape
        x = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        y: torch.Tensor
        if x.shape[0] >= dense_rows():
            y = self._dense(x.to(ggml_kernel.dense_dtype())).to(x.dtype)  # bf16 where multiplied
        else:
            y = torch.ops.glassbox.ggml_mm(x, self.raw, self.qtype)
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.out_features)

    def _dense(self, panels: torch.Tensor) -> torch.Tensor:
        """A prefill's product, each joined tensor on its own: a matrix unit sums a column
        differently in panels of different widths, and the widths follow the rows, so q, k and
        v joined here must be multiplied as a placed model multiplies them apart."""
        multiply = torch.ops.glassbox.ggml_dense_mm
        if not self.part_rows:
            whole: torch.Tensor = multiply(panels, self.raw, self.qtype)
            return whole
        starts = [sum(self.part_rows[:i]) for i in range(len(self.part_rows))]
        parts = [self.raw.narrow(0, a, n) for a, n in zip(starts, self.part_rows, strict=True)]
        return torch.cat([multiply(panels, rows, self.qtype) for rows in parts], dim=1)
