"""Every GGUF block layout the fast path reads, against gguf's own numpy dequantize: unpacking
bit for bit, each kernel layout's product within bf16 rounding of x @ Wᵀ."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import ggml_blocks, quant

ALL = [quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1, quant.Q8_0, quant.Q4_K, quant.Q5_K,
       quant.Q6_K]  # fmt: skip
HALF_OFFSETS = {  # where each type keeps its f16 scales (d, dmin or m): set to sane values
    quant.Q4_0: (0,), quant.Q5_0: (0,), quant.Q8_0: (0,), quant.Q4_1: (0, 2),
    quant.Q5_1: (0, 2), quant.Q4_K: (0, 2), quant.Q5_K: (0, 2), quant.Q6_K: (208,),
}  # fmt: skip


def random_blocks(qtype: int, rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Random bytes of `qtype` rows uint8 [rows, row_bytes], with finite f16 scales."""
    rng = np.random.default_rng(seed)
    blocks = columns // ggml_blocks.BLOCK_VALUES[qtype]
    raw = rng.integers(0, 256, (rows, blocks, ggml_blocks.BLOCK_BYTES[qtype]), dtype=np.uint8)
    for at in HALF_OFFSETS[qtype]:
        halves = (rng.standard_normal((rows, blocks, 1)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = halves.view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


def reference(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    import gguf

    values = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(values.reshape(raw.shape[0], -1))


@pytest.mark.parametrize("qtype", ALL)
def test_unpacking_equals_gguf_dequantize_bit_for_bit(qtype):
    raw = random_blocks(qtype, 48, 512)
    ours = quant.dequantize(raw, qtype)
    assert torch.equal(ours.view(torch.int32), reference(raw, qtype).view(torch.int32))


@pytest.mark.parametrize("qtype", [t for t in ALL if t != quant.Q6_K])
def test_int4_layout_of_each_type_equals_the_dequantised_matmul(qtype):
    """Plain types (one product) and split ones (two halves) alike: float32 scales reproduce
    the file's numbers, bf16 ones (the fast model's) are within bf16 rounding."""
    raw = random_blocks(qtype, 128, 512, seed=qtype)
    weights = reference(raw, qtype)
    linear = quant.Int4Linear.from_blocks(raw, qtype, torch.float32)
    assert linear.plain == (qtype in quant.PLAIN)
    assert linear.packed.shape[0] == (128 if qtype in quant.PLAIN else 256)
    torch.testing.assert_close(linear.dense(), weights, rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 512)
    expected = x @ weights.T
    scale = expected.abs().max()
    torch.testing.assert_close(linear(x), expected, rtol=0, atol=1e-5 * scale)
    fast = quant.Int4Linear.from_blocks(raw, qtype, torch.bfloat16)
    for batch in (x, torch.randn(quant.DENSE_ROWS + 3, 512)):  # the kernel, then unpacked
        expected = batch @ weights.T
        error = (fast(batch).float() - expected).norm() / expected.norm()
        assert error < 1e-2


def test_q6_k_layout_is_exact_and_its_products_agree():
    raw = random_blocks(quant.Q6_K, 96, 512)
    weights = reference(raw, quant.Q6_K)
    linear = quant.Q6KLinear.from_blocks(raw)
    assert linear.values.dtype == torch.int8 and linear.scales.shape == (96, 512 // 16)
    assert torch.equal(linear.dense(), weights)
    x = torch.randn(2, 512)
    expected = x @ weights.T
    scale = expected.abs().max()
    torch.testing.assert_close(linear.decode_product(x), expected, rtol=0, atol=1e-5 * scale)
    error = (linear(x).float() - expected).norm() / expected.norm()
    assert error < 1e-2  # bf16 activations and weights


def test_parts_of_different_layouts_concatenate_their_outputs():
    q4 = random_blocks(quant.Q4_K, 64, 256, seed=1)
    q6 = random_blocks(quant.Q6_K, 32, 256, seed=2)
    parts = quant.PartsLinear(
        [
            quant.Int4Linear.from_blocks(q4, quant.Q4_K, torch.float32),
            quant.Q6KLinear.from_blocks(q6),
        ]
    )
    assert (parts.out_features, parts.in_features) == (96, 256)
    x = torch.randn(1, 256)
    expected = x @ torch.cat([reference(q4, quant.Q4_K), reference(q6, quant.Q6_K)]).T
    error = (parts(x).float() - expected).norm() / expected.norm()
    assert error < 1e-2


@pytest.mark.parametrize("qtype", ALL)
def test_row_reader_reads_rows_as_gguf_dequantizes_them(qtype):
    raw = random_blocks(qtype, 40, 512, seed=3)
    rows = quant.RowReader(raw, qtype, 512)
    index = torch.tensor([3, 0, 39, 3])
    expected = reference(raw, qtype)
    assert torch.equal(rows(index), expected[index])
    assert torch.equal(rows.all(), expected)
