"""The largest logits in two short passes equal torch's argmax and topk."""

import math
import types

import pytest
import torch

from engine.model import largest
from engine.model.largest import (
    argmax,
    top_k,
    top_k_rows,
    top_k_rows_torch,
    top_k_softmax,
    top_k_support,
)
from engine.weights import ggml_kernel


@pytest.mark.parametrize("size", [49152, 128 * 3, 1000, 7])
def test_two_pass_argmax_is_torchs_argmax(size):
    """First largest entry, with ties and a NaN, on lengths that take both paths."""
    generator = torch.Generator().manual_seed(size)
    for trial in range(200):
        values = torch.randn(size, generator=generator).bfloat16().float()  # many ties
        if trial % 3 == 0:
            values[torch.randint(0, size, (2,), generator=generator)] = values.max() + 1
        if trial == 7:
            values[size // 2] = float("nan")
        assert int(argmax(values)) == int(values.argmax())


@pytest.mark.parametrize("size", [49152, 128 * 3, 1000, 7])
def test_two_pass_top_k_support_is_every_entry_reaching_torchs_kth(size):
    """The entries at least the k-th largest (ties included: many here), for k within and past
    the rows of 128, as topk and nonzero over the whole vector find them."""
    generator = torch.Generator().manual_seed(size)
    for trial in range(100):
        values = torch.randn(size, generator=generator).bfloat16().float()  # many ties
        for k in {1, 3, min(50, size), min(size // 128 + 1, size)}:
            expected = (values >= values.topk(k).values[-1]).nonzero()[:, 0]
            assert top_k_support(values, k).tolist() == expected.tolist(), (trial, k)


@pytest.mark.parametrize("size", [49152, 128 * 3, 1000, 7])
def test_two_pass_top_k_is_torchs_topk(size):
    """The k largest values, largest first, exactly torch's; each index holds its value (among
    equal values torch names no particular index)."""
    generator = torch.Generator().manual_seed(size)
    for trial in range(100):
        values = torch.randn(size, generator=generator).bfloat16().float()  # many ties
        if trial % 4 == 0:
            values[: size // 2] = -1e9  # the largest crowded into few rows
        for k in sorted({1, min(10, size), min(64, size), min(size // 128 + 1, size)}):
            expected = values.topk(k)
            got_values, got_indices = top_k(values, k)
            assert torch.equal(got_values, expected.values), (trial, k)
            assert torch.equal(values[got_indices], got_values), (trial, k)
            assert len(set(got_indices.tolist())) == k, (trial, k)


def test_top_k_rows_of_one_row_or_several_are_topks():
    values = torch.randn(3, 128 * 40, generator=torch.Generator().manual_seed(1))
    for rows in (values[:1], values):
        got = top_k_rows(rows, 64)
        assert got.shape == (rows.shape[0], 64)
        for row, indices in zip(rows, got, strict=True):
            assert sorted(row[indices].tolist()) == sorted(row.topk(64).values.tolist())


def test_top_k_rows_are_each_rows_topk():
    generator = torch.Generator().manual_seed(2)
    for size, k in ((128 * 384, 10), (128 * 384, 64), (1000, 10), (128 * 4, 8)):
        values = torch.randn(5, size, generator=generator).bfloat16().float()  # many ties
        values[1, : size // 2] = -1e9  # the largest crowded into few rows
        got = top_k_rows(values, k)
        expected = values.topk(k, dim=-1).values
        assert torch.equal(values.gather(1, got), expected)
        assert all(len(set(row)) == k for row in got.tolist())


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernels_top_k_rows_are_the_torch_ways(dtype):
    """The C++ op (where the GGML kernels load) and the torch ops give each row's same k
    largest values, largest first; among equal values the op names the lower index first.
    Rows with many ties, the largest crowded into few blocks, -inf, and k past the blocks."""
    generator = torch.Generator().manual_seed(3)
    for size, k in ((128 * 384, 64), (128 * 384, 10), (128 * 4, 4), (128 * 4, 1)):
        values = torch.randn(6, size, generator=generator).to(dtype)  # bf16: many ties
        values[1, : size // 2] = -1e9
        values[2, 5:] = float("-inf")  # fewer finite values than k
        values[3] = 1.5  # all equal
        got = torch.ops.glassbox.top_k_rows(values, k)
        want = top_k_rows_torch(values, k)
        assert got.shape == want.shape == (6, k) and got.dtype == torch.int64
        assert torch.equal(values.gather(1, got), values.gather(1, want))
        assert torch.equal(values.gather(1, got), values.topk(k, dim=-1).values)
        for row, indices in zip(values, got.tolist(), strict=True):
            pairs = [(-float(row[i]), i) for i in indices]
            assert pairs == sorted(pairs)  # equal values: the lower index first
        assert top_k_rows(values, k).tolist() == got.tolist()  # the op is what runs here


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
def test_the_kernels_top_k_rows_refuses_what_it_cannot_rank():
    with pytest.raises(RuntimeError, match="NaN"):
        torch.ops.glassbox.top_k_rows(torch.full((1, 256), float("nan")), 3)
    with pytest.raises(RuntimeError, match="float32 or bf16"):
        torch.ops.glassbox.top_k_rows(torch.zeros(1, 256, dtype=torch.float64), 3)
    with pytest.raises(RuntimeError, match="within 1"):
        torch.ops.glassbox.top_k_rows(torch.zeros(1, 256), 0)


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
def test_top_k_softmax_is_the_rows_softmax_at_their_top_k(monkeypatch):
    """The C++ op (one call for a batch of rows) against float64's softmax: the same indices
    as top_k_rows, probabilities within float32's rounding; and the torch way where the
    kernels do not load gives the same."""
    generator = torch.Generator().manual_seed(4)
    rows = [torch.randn(128 * 384, generator=generator) * scale for scale in (0.1, 3.0, 30.0)]
    rows[1][:1000] = float("-inf")  # masked entries weigh nothing
    got_indices, got_probs = top_k_softmax(rows, 10)
    assert got_indices.shape == got_probs.shape == (3, 10) and got_probs.dtype == torch.float32
    stacked = torch.stack(rows)
    assert torch.equal(got_indices, top_k_rows(stacked, 10))
    exact = torch.softmax(stacked.double(), dim=-1).gather(1, got_indices)
    torch.testing.assert_close(got_probs.double(), exact, rtol=2e-6, atol=1e-9)
    monkeypatch.setattr(largest, "ggml_kernel", types.SimpleNamespace(ensure=lambda: "off"))
    torch_indices, torch_probs = top_k_softmax(rows, 10)
    assert torch.equal(torch_indices.gather(1, torch.zeros(3, 1, dtype=torch.long)),
                       got_indices[:, :1])  # fmt: skip
    # torch's float32 softmax sums the row in float32: its rounding grows with the row's
    # length (2.3e-6 under the AVX2 kernel set here, 0.9e-6 under AVX-512), the op's does not
    float32_sum = math.sqrt(stacked.shape[1]) * torch.finfo(torch.float32).eps
    torch.testing.assert_close(torch_probs.double(), exact, rtol=float32_sum, atol=1e-9)


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
def test_top_k_softmax_refuses_a_row_without_a_finite_largest():
    with pytest.raises(RuntimeError, match="not finite"):
        torch.ops.glassbox.top_k_softmax([torch.full((256,), float("-inf"))], 3)
