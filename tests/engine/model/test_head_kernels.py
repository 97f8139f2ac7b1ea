"""The fast head's C++ ops (engine/weights/kernels/head.h) against independent references:
gguf's dequantize, torch's argmax, float64 products and norms. Each is one call where the
torch way between two decode steps was several ops; each must compute what that way did."""

from __future__ import annotations

import pytest
import torch

from engine.model import largest
from engine.model.layer import norm_row
from engine.model.llama import Head, final_norm, final_norm_rows, rms_norm
from engine.weights import ggml_kernel
from engine.weights.linear import RowReader
from tests.engine.weights.test_linear import random_blocks, reference

pytestmark = pytest.mark.skipif(
    ggml_kernel.ensure() is not None, reason=f"no GGML kernels here: {ggml_kernel.ensure()}"
)

TYPES = list(ggml_kernel.TYPES)


@pytest.mark.parametrize("qtype", TYPES)
def test_ggml_rows_are_gguf_dequantize(qtype):
    """The same values (a zero may carry the other sign: q·d - 8·d where gguf has d·(q - 8))."""
    raw = random_blocks(qtype, 48, 512, seed=qtype)
    index = torch.tensor([3, 0, 47, 3])
    rows = torch.ops.glassbox.ggml_rows(raw, index, qtype, 512)
    assert torch.equal(rows, reference(raw, qtype)[index])
    assert torch.equal(RowReader(raw, qtype, 512)(index), rows)  # the reader takes the op


def test_ggml_rows_refuses_an_index_out_of_range():
    raw = random_blocks(ggml_kernel.TYPES[0], 4, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.glassbox.ggml_rows(raw, torch.tensor([4]), ggml_kernel.TYPES[0], 64)


@pytest.mark.parametrize("size", [1, 7, 8, 9, 1000, 49152])
def test_first_largest_is_torchs_argmax(size):
    """First largest with many ties, a NaN (torch takes the first NaN), -inf throughout."""
    generator = torch.Generator().manual_seed(size)
    for trial in range(100):
        values = torch.randn(size, generator=generator).bfloat16().float()
        if trial % 3 == 0:
            values[torch.randint(0, size, (2,), generator=generator)] = values.max() + 1
        if trial % 10 == 7:
            values[torch.randint(0, size, (2,), generator=generator)] = float("nan")
        if trial == 50:
            values.fill_(float("-inf"))
        first = torch.ops.glassbox.first_largest(values)
        assert first.dim() == 0 and first.dtype == torch.long
        assert int(first) == int(values.argmax())
        assert int(largest.argmax(values)) == int(values.argmax())


def _bulk_and_rows(qtype: int, n: int = 3, vocab: int = 1024, dim: int = 256):
    """A bulk product's logits (bf16, many ties), the head's rows and activations."""
    generator = torch.Generator().manual_seed(qtype)
    raw = random_blocks(qtype, vocab, dim, seed=qtype)
    x = torch.randn(n, dim, generator=generator).bfloat16()
    bulk = (torch.randn(n, vocab, generator=generator) * 4).bfloat16()
    return bulk, raw, x


@pytest.mark.parametrize("qtype", TYPES)
def test_exact_head_replaces_each_rows_top_k_by_its_float64_product(qtype):
    bulk, raw, x = _bulk_and_rows(qtype)
    k = 8
    out = torch.ops.glassbox.exact_head(bulk, raw, qtype, x, k)
    top = largest.top_k_rows(bulk, k)  # the rows the Head recomputes (ties: the lower index)
    weights = reference(raw, qtype).double()
    exact = torch.einsum("nkd,nd->nk", weights[top], x.double())
    kept = torch.ones_like(out, dtype=torch.bool).scatter_(-1, top, False)
    assert torch.equal(out[kept], bulk.float()[kept])  # the rest: the bulk product's own
    error = (out.gather(-1, top).double() - exact).abs()
    assert (error <= exact.abs() * 2**-24 + 1e-30).all()  # float64, rounded once to float32


def test_exact_head_leaves_a_float32_product_as_it_was():
    bulk, raw, x = _bulk_and_rows(ggml_kernel.TYPES[-1])
    product = bulk.float()
    kept = product.clone()
    out = torch.ops.glassbox.exact_head(product, raw, ggml_kernel.TYPES[-1], x, 8)
    assert torch.equal(product, kept) and not torch.equal(out, kept)


def test_exact_head_takes_each_row_alone():
    """A batch's rows (the logit lens's layers) equal the same rows one at a time."""
    qtype = ggml_kernel.TYPES[-1]
    bulk, raw, x = _bulk_and_rows(qtype, n=5)
    batch = torch.ops.glassbox.exact_head(bulk, raw, qtype, x, 8)
    for i in range(5):
        one = torch.ops.glassbox.exact_head(bulk[i : i + 1], raw, qtype, x[i : i + 1], 8)
        assert torch.equal(one[0], batch[i])


class _Bulk(torch.nn.Module):
    """A bulk product that returns fixed logits (the Head's first step)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits


@pytest.mark.parametrize("qtype", TYPES)
def test_the_heads_kernel_way_is_its_torch_way_within_float32(qtype, monkeypatch):
    bulk, raw, x = _bulk_and_rows(qtype)
    head = Head(
        _Bulk(bulk),
        RowReader(  # type: ignore[arg-type]
            raw, qtype, x.shape[1]
        ),
        candidates=8,
    )
    ours = head.forward(x)
    monkeypatch.setattr(Head, "_in_kernels", lambda self, logits: False)
    monkeypatch.setattr(RowReader, "in_kernels", False)
    torch_way = head.forward(x)
    assert torch.allclose(ours, torch_way, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours.topk(8).indices, torch_way.topk(8).indices)


def test_norm_rows_is_the_float64_norm_rounded_to_bf16():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(6, 576, generator=generator) * 3
    weight = torch.rand(576, generator=generator) + 0.5
    eps = 1e-5
    ours = torch.ops.glassbox.norm_rows(x, weight, eps)
    assert ours.dtype == torch.bfloat16
    x64 = x.double()
    exact = x64 * weight.double() / (x64.square().mean(-1, keepdim=True) + eps).sqrt()
    # within one bf16 rounding of the float64 norm (2^-8 relative), plus float32's steps
    assert ((ours.double() - exact).abs() <= exact.abs() * (2**-8 + 1e-6)).all()
    torch_way = torch.cat([norm_row(row[None], weight, torch.tensor(eps)) for row in x])
    assert (ours != torch_way).float().mean() < 0.01  # rarely a rounding apart
    assert torch.equal(final_norm(x, weight, eps), ours)
    assert torch.equal(final_norm_rows(x, weight, eps)[2], final_norm(x[2:3], weight, eps)[0])


def test_the_final_norm_without_the_kernels_is_rms_norm(monkeypatch):
    monkeypatch.setattr(ggml_kernel, "ensure", lambda: "no kernels")
    x, weight = torch.randn(3, 64), torch.rand(64) + 0.5
    assert torch.equal(final_norm(x, weight, 1e-6), rms_norm(x, weight, 1e-6))
    rows = torch.cat([rms_norm(row[None], weight, 1e-6) for row in x])
    assert torch.equal(final_norm_rows(x, weight, 1e-6), rows)
