"""Every GGUF block layout the fast path reads, against gguf's own numpy dequantize: unpacking
bit for bit, each kernel layout's product within bf16 rounding of x @ Wᵀ."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from engine.gguf import blocks as ggml_blocks
from engine.gguf.reader import GGUFFile
from engine.model import fast_builder
from engine.model.reference import build_exact
from engine.weights import linear as quant
from engine.weights.pack_cache import PackCache, pack_path
from tests.engine.model.test_fast import assert_follows_logits
from tests.gguf_files import Q4_0, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, write_gguf
from tests.models import tiny_config

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [128, 96])  # 96: not whole blocks of 64, packed by torch's op
def test_q6_k_in_int4_groups_of_its_own_is_the_dequantised_matmul(dtype, rows):
    """Each 16 values as 32 nibbles against x and 8·x (quant.Q6KLinear): the kernel's product
    (a decode step) and the unpacked weights (a prefill) are the file's numbers."""
    raw = random_blocks(quant.Q6_K, rows, 512)
    weights = reference(raw, quant.Q6_K)
    linear = quant.Q6KLinear.from_blocks(raw, dtype)
    assert linear.nbytes == rows * 512 + (512 // 16) * rows * 2 * dtype.itemsize  # 1.25 B/w
    exact = dtype == torch.float32  # float32 scales: the same numbers; bf16 rounds them
    if exact or linear.interleaved.unpackable:  # else read back through the kernel: rounded
        torch.testing.assert_close(
            linear.dense().float(), weights, rtol=0 if exact else 8e-3, atol=1e-6 * weights.std()
        )
    for rows in (1, 2, quant.DENSE_ROWS + 3):  # the kernel, then unpacked
        x = torch.randn(rows, 512)
        expected = x @ weights.T
        error = (linear(x.to(dtype)).float() - expected).norm() / expected.norm()
        assert error < (1e-5 if exact else 1e-2), (rows, error)


@pytest.mark.parametrize(
    "types", [(quant.Q4_0, quant.Q4_K, quant.Q4_1), (quant.Q5_0, quant.Q8_0, quant.Q5_K)]
)
def test_parts_of_one_layout_join_into_one_product(types):
    """Rows joined before packing (parts of 40 and 24 rows: not whole blocks of 64), split
    ones as every part's hi rows, then every part's lo rows."""
    raws = [random_blocks(t, n, 256, seed=n) for t, n in zip(types, (40, 24, 64), strict=True)]
    linear = quant.Int4Linear.from_parts(list(zip(raws, types, strict=True)), torch.float32)
    weights = torch.cat([reference(r, t) for r, t in zip(raws, types, strict=True)])
    assert linear.out_features == 128
    torch.testing.assert_close(linear.dense(), weights, rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 256)
    expected = x @ weights.T
    torch.testing.assert_close(linear(x), expected, rtol=0, atol=1e-5 * expected.abs().max())


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


# -- a model of mixed types, as llama.cpp's Q4_K_M files mix them ------------------------------

MIXED = {  # q/k and v of different layouts (Qwen's), gate/up of two split types (Gemma's)
    "attn_q.weight": Q4_K, "attn_k.weight": Q4_K, "attn_v.weight": Q6_K,
    "attn_output.weight": Q5_K, "ffn_gate.weight": Q5_0, "ffn_up.weight": Q8_0,
    "ffn_down.weight": Q6_K,
}  # fmt: skip


def mixed_gguf(path, head: str, architecture: str = "qwen2"):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(architecture, hidden_size=256, intermediate_size=256, head_dim=64)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return write_gguf(path, model, Q4_0, Q4_K, types={**MIXED, "output.weight": head})


# Q6_K in int4 groups of its own where the AVX-512 kernels run, else a bf16 copy (faster there)
Q6_LAYOUT = quant.Q6KLinear if quant.kernel_block_rows() == 64 else quant.DenseLinear


@pytest.mark.usefixtures("int4_layouts")
@pytest.mark.parametrize("head", [Q4_K, Q6_K])
def test_mixed_types_fuse_by_layout_and_follow_the_exact_model(head, tmp_path, caplog):
    file = GGUFFile(mixed_gguf(tmp_path / "mixed.gguf", head))
    with caplog.at_level(logging.INFO, logger="engine.model.fast_builder"):
        fast = fast_builder.build_fast(file)
    block = fast.blocks[0]
    qkv = block.attention.qkv
    assert isinstance(qkv, quant.PartsLinear)  # [q; k] one int4 product, v another
    q_k, v = qkv.linears()
    assert isinstance(q_k, quant.Int4Linear) and q_k.plain and q_k.out_features == 256 + 128
    assert isinstance(v, Q6_LAYOUT) and v.out_features == 128
    gate_up = block.feed_forward.gate_up  # Q5_0 and Q8_0: both split, one product
    assert isinstance(gate_up, quant.Int4Linear) and not gate_up.plain
    assert isinstance(block.attention.out, quant.Int4Linear)  # Q5_K
    assert isinstance(block.feed_forward.down, Q6_LAYOUT)
    if head == Q4_K:  # repacked as it is: the file's numbers
        rows = quant.RowReader(torch.from_numpy(file.raw("output.weight")), 12, 256)
        torch.testing.assert_close(fast.output.bulk.dense().float(), rows.all(), rtol=0.01,
                                   atol=0.01 * float(rows.all().abs().max()))  # fmt: skip
    notes = [r.getMessage() for r in caplog.records if "bf16" in r.getMessage()]
    if Q6_LAYOUT is quant.DenseLinear:  # what the bf16 copies cost is logged
        (note,) = notes
        assert "blk.*.attn_v.weight (2), blk.*.ffn_down.weight (2)" in note and "Q6_K" in note
        assert "MB held for" in note
    else:
        assert notes == []  # nothing dequantised

    exact = build_exact(file, torch.float32)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = exact(ids).logits[0]
    scale = expected.abs().max() * (0.05 if head == Q4_K else 0.1)
    assert_follows_logits(fast, ids, expected, scale, prefill=9)


@pytest.mark.usefixtures("int4_layouts")
def test_a_second_build_of_mixed_types_reads_everything_from_the_pack(tmp_path, monkeypatch):
    """Every layout is kept (int4, split int4, the bf16 copies of Q6_K): the second build
    repacks and dequantises nothing, and holds the same weights."""
    path = mixed_gguf(tmp_path / "mixed.gguf", Q6_K)
    file = GGUFFile(path)
    fresh = fast_builder.build_fast(file)
    first = PackCache(pack_path(tmp_path, path.stem, "key"), path.stem)
    fast_builder.build_fast(file, packs=first)
    assert first.missed

    def refuse(*args, **kwargs):
        raise AssertionError("repacked or dequantised a weight the pack holds")

    monkeypatch.setattr(quant.Int4Linear, "from_parts", refuse)
    monkeypatch.setattr(quant.Int4Linear, "requantized", refuse)
    monkeypatch.setattr(fast_builder, "_dense", refuse)
    again = PackCache(pack_path(tmp_path, path.stem, "key"), path.stem)
    model = fast_builder.build_fast(file, packs=again)
    assert not again.missed
    buffers = dict(model.named_buffers())
    for name, expected in fresh.named_buffers():
        assert torch.equal(buffers[name], expected), name
    ids = torch.randint(0, 49152, (1, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.forward(ids, None, None), fresh.forward(ids, None, None))


def test_the_compiled_step_takes_every_layout_build_fast_makes(tmp_path):
    """Mixed K-quants, halves, Q6_K's own groups (or its bf16 copy) and biases: none is a
    reason to decode eagerly (test_compiled_decode runs such a model compiled)."""
    from engine.step import compiled as compiled_decode

    path = mixed_gguf(tmp_path / "mixed.gguf", Q6_K)
    model = fast_builder.build_fast(GGUFFile(path))
    if compiled_decode._package_loader() is not None:  # else it refuses for the torch
        assert compiled_decode.refusal(model) is None
