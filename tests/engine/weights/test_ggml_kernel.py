"""The GGML kernels (engine/kernels/ggml_dot.cpp) against gguf's own dequantize: their
dequantisation bit for bit, their products within what rounding the activations to int8 per
block can change, and a fast model built on them against the exact model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gguf import blocks as ggml_blocks
from engine.gguf.reader import GGUFFile
from engine.model import fast_builder
from engine.model.reference import build_exact
from engine.step import compiled
from engine.weights import ggml_kernel
from engine.weights import linear as quant
from tests.engine.model.test_fast import assert_follows_logits
from tests.engine.weights.test_linear import mixed_gguf, random_blocks, reference
from tests.gguf_files import Q6_K

pytestmark = pytest.mark.skipif(
    ggml_kernel.ensure() is not None, reason=f"no GGML kernels here: {ggml_kernel.ensure()}"
)

TYPES = list(ggml_kernel.TYPES)


def rounded_activations(x: torch.Tensor, size: int) -> torch.Tensor:
    """x [m, k] as the kernels round it: int8 = rint(x·127/max|x|) per `size` values."""
    blocks = x.float().numpy().reshape(x.shape[0], -1, size)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inverse = np.where(amax > 0, np.float32(127) / np.maximum(amax, 1e-30), 0).astype(np.float32)
    q = np.rint(blocks * inverse)
    return torch.from_numpy((q * (amax / np.float32(127))).reshape(x.shape))


@pytest.mark.parametrize("qtype", TYPES)
def test_dequantize_is_gguf_dequantize_rounded_to_bf16(qtype):
    raw = random_blocks(qtype, 48, 512, seed=qtype)
    ours = torch.ops.glassbox.ggml_dequantize(raw, qtype, 512)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours, reference(raw, qtype).to(torch.bfloat16))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qtype", TYPES)
def test_product_is_the_matmul_within_the_activations_rounding(qtype, rows):
    """|kernel - x·Wᵀ| stays within Σ|w|·|x - x̂| (x̂: x rounded as the kernel rounds it), a
    bound any misread nibble, scale or offset breaks by orders of magnitude."""
    raw = random_blocks(qtype, 64, 512, seed=qtype + rows)
    weights = reference(raw, qtype).double()
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(qtype))
    rounded = rounded_activations(x, ggml_blocks.BLOCK_VALUES[qtype]).double()
    exact = x.double() @ weights.T
    # the 32-value types multiply their offsets by the unrounded sums: |w - offset| bounds theirs
    offsets = reference_offsets(raw, qtype)
    bound = (weights.abs() + offsets).matmul((x.double() - rounded).abs().T).T
    ours = torch.ops.glassbox.ggml_mm(x, raw, qtype).double()
    assert ours.shape == (rows, 64)
    slack = 1e-5 * exact.abs().max()  # float32 sums
    assert ((ours - exact).abs() <= bound + slack).all()
    assert (ours - exact).abs().max() > 0  # the rounding is there: this is not the reference


def reference_offsets(raw: torch.Tensor, qtype: int) -> torch.Tensor:
    """|offset| per weight for the 32-value types (0 for the others), [rows, columns]."""
    if qtype not in (quant.Q4_0, quant.Q4_1, quant.Q5_0, quant.Q5_1):
        return torch.zeros(1, dtype=torch.float64)
    _, _, offset = ggml_blocks.unpack(raw, qtype)
    return offset.double().abs().repeat_interleave(32, dim=1)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_dense_product_is_the_dequantised_matmul_panel_by_panel(qtype):
    """ggml_dense_mm (a prefill's product: panels of rows dequantised and multiplied in turn)
    against one bf16 matmul of the whole dequantised tensor: 601 rows of 4096 values make
    panels of at most 256 rows (2 MB of bf16), the last one partial; every output column is
    checked, so a panel written to the wrong place, a row left out or a misread block shows."""
    raw = random_blocks(qtype, 601, 4096, seed=qtype + 7)
    x = torch.randn(24, 4096, generator=torch.Generator().manual_seed(qtype)).bfloat16()
    weights = torch.ops.glassbox.ggml_dequantize(raw, qtype, 4096)
    expected = torch.nn.functional.linear(x, weights).float()
    ours = torch.ops.glassbox.ggml_dense_mm(x, raw, qtype)
    assert ours.dtype == torch.bfloat16 and ours.shape == (24, 601)
    # the same bf16 products summed in float32 in another order: within a bf16 step or two
    torch.testing.assert_close(ours.float(), expected, rtol=2e-2, atol=1e-3 * expected.abs().max())
    exact = x.double() @ reference(raw, qtype).double().T
    assert ((ours.double() - exact).norm() / exact.norm()).item() < 1e-2
    assert torch.ops.glassbox.ggml_dense_mm(x.float(), raw, qtype).dtype == torch.float32


def test_a_joined_weight_multiplies_a_prompt_as_its_parts_do():
    """q, k and v of one type are one weight in memory and three where a placed model maps
    them from the file: a prompt's products must agree bit for bit. Panels of bf16 rows summed
    by a matrix unit differ with the panel's width (which follows the rows), so a joined
    weight multiplies each of its tensors on its own."""
    rows = (1536, 256, 256)  # Qwen2.5-1.5B's q, k and v
    parts = [random_blocks(quant.Q4_K, n, 1536, seed=i) for i, n in enumerate(rows)]
    joined = quant.GGMLLinear(torch.cat(parts), quant.Q4_K, 1536, rows)
    apart = quant.PartsLinear([quant.GGMLLinear(raw, quant.Q4_K, 1536) for raw in parts])
    for m in (17, 36, 64, 100, 200):  # prompts: the dense product (and its panels) from 16
        x = torch.randn(m, 1536, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert torch.equal(joined.forward(x), apart.forward(x)), m
    step = torch.randn(1, 1536).bfloat16()  # a decode step's product sums integers: any way
    assert torch.equal(joined.forward(step), apart.forward(step))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_dense_product_runs_under_inference_mode_on_every_thread(dtype):
    """The logit lens multiplies its layers' rows under torch.inference_mode, which is per
    thread: the panels' other threads wrote an output made under it and at::mm_out refused
    ("Inplace update to inference tensor outside InferenceMode"), whenever one took a panel."""
    raw = random_blocks(quant.Q4_K, 2048, 1536, seed=5)  # 4+ panels: both threads take some
    x = torch.randn(28, 1536, generator=torch.Generator().manual_seed(5)).to(dtype)
    expected = torch.ops.glassbox.ggml_dense_mm(x, raw, quant.Q4_K)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for _ in range(8):
            with torch.inference_mode():
                inside = torch.ops.glassbox.ggml_dense_mm(x, raw, quant.Q4_K)
            assert torch.equal(inside, expected)
            assert torch.equal(torch.ops.glassbox.ggml_dense_mm(x, raw, quant.Q4_K), expected)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("qtype", [quant.Q4_K, quant.Q6_K, quant.Q8_0])
def test_float_activations_multiply_float_panels_of_gguf_values(qtype):
    """Float32 x takes float32 panels (a CPU without bf16 dot products): gguf's dequantised
    values unrounded, so the product is x·Wᵀ to float32's precision, not bf16's; 601 rows make
    float32 panels of at most 128 rows, the last one partial."""
    raw = random_blocks(qtype, 601, 4096, seed=qtype + 11)
    x = torch.randn(20, 4096, generator=torch.Generator().manual_seed(qtype))
    exact = x.double() @ reference(raw, qtype).double().T
    ours = torch.ops.glassbox.ggml_dense_mm(x, raw, qtype)
    assert ours.dtype == torch.float32 and ours.shape == (20, 601)
    assert ((ours.double() - exact).norm() / exact.norm()).item() < 1e-6
    in_bf16 = torch.ops.glassbox.ggml_dense_mm(x.bfloat16(), raw, qtype).double()
    assert ((in_bf16 - exact).norm() / exact.norm()).item() > 1e-4  # what float32 panels spare


@pytest.mark.parametrize("qtype", TYPES)
def test_float32_panels_hold_gguf_values_bit_for_bit(qtype):
    """The identity through float32 panels gives the panels themselves (each product a single
    1·w, summed with zeros): gguf's dequantised values exactly, the K-quants' made eight at a
    time as its numpy makes them one by one (a fused multiply-add would differ in the last bit)."""
    raw = random_blocks(qtype, 40, 512, seed=qtype + 13)
    panels = torch.ops.glassbox.ggml_dense_mm(torch.eye(512), raw, qtype)
    assert torch.equal(panels, reference(raw, qtype).float().T)


@pytest.mark.parametrize(
    ("flags", "dtype"),
    [
        ({"avx2", "avx512f", "avx512_bf16"}, torch.bfloat16),
        ({"avx2", "amx_bf16"}, torch.bfloat16),
        ({"avx2", "avx512f", "avx512_vnni"}, torch.float32),
        (set(), torch.float32),
    ],
)
def test_a_prefill_takes_bf16_panels_only_where_the_cpu_multiplies_bf16(monkeypatch, flags, dtype):
    monkeypatch.setattr(ggml_kernel, "cpu_flags", lambda: frozenset(flags))
    ggml_kernel.dense_dtype.cache_clear()
    try:
        assert ggml_kernel.dense_dtype() == dtype
        raw = random_blocks(quant.Q4_K, 32, 256, seed=5)
        seen: list[torch.dtype] = []
        real = torch.ops.glassbox.ggml_dense_mm

        def spy(x: torch.Tensor, *rest: object) -> torch.Tensor:
            seen.append(x.dtype)
            return real(x, *rest)

        monkeypatch.setattr(torch.ops.glassbox, "ggml_dense_mm", spy)
        y = quant.GGMLLinear(raw, quant.Q4_K, 256)(torch.randn(quant.dense_rows(), 256))
        assert seen == [dtype] and y.dtype == torch.bfloat16  # the model's dtype either way
    finally:
        ggml_kernel.dense_dtype.cache_clear()


def test_bf16_activations_give_bf16_and_float_give_float():
    raw = random_blocks(quant.Q4_K, 16, 256)
    x = torch.randn(2, 256)
    assert torch.ops.glassbox.ggml_mm(x, raw, quant.Q4_K).dtype == torch.float32
    assert torch.ops.glassbox.ggml_mm(x.bfloat16(), raw, quant.Q4_K).dtype == torch.bfloat16


def test_a_row_of_the_wrong_size_is_refused():
    raw = random_blocks(quant.Q4_K, 16, 512)
    with pytest.raises(RuntimeError, match="row bytes do not match"):
        torch.ops.glassbox.ggml_mm(torch.randn(1, 256), raw[:, :144], quant.Q6_K)
    with pytest.raises(RuntimeError, match="no kernel here"):
        torch.ops.glassbox.ggml_mm(torch.randn(1, 512), raw, quant.Q5_K)


@pytest.mark.parametrize("qtype", [quant.Q4_K, quant.Q6_K])
def test_a_prefill_dequantises_and_a_step_takes_the_kernel(qtype):
    """From `dense_rows()` rows the product is the dequantised matmul; below, the kernel's:
    both within a percent of x·Wᵀ."""
    raw = random_blocks(qtype, 64, 512, seed=3)
    linear = quant.GGMLLinear(raw, qtype, 512)
    weights = reference(raw, qtype)
    for rows in (1, quant.dense_rows() - 1, quant.dense_rows(), 40):
        x = torch.randn(rows, 512)
        expected = x @ weights.T
        y = linear(x)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, 64)
        assert (y.float() - expected).norm() / expected.norm() < 1e-2
    batch = torch.randn(2, quant.dense_rows(), 512)  # leading dims kept
    assert linear(batch).shape == (2, quant.dense_rows(), 64)


@pytest.mark.parametrize("qtype", TYPES)
def test_a_prompts_rows_are_their_one_row_products(qtype):
    """Below `dense_rows()` a block of weights is unpacked once for four rows of activations:
    each row's sums are made in the order of a decode step's, so every row of a 7-row product
    (a group of four, then of three) equals that row's product alone, bit for bit; 70 weight
    rows cross the blocks of 32 the rows go through."""
    raw = random_blocks(qtype, 70, 512, seed=qtype + 5)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(qtype)).bfloat16()
    together = torch.ops.glassbox.ggml_mm(x, raw, qtype)
    alone = torch.cat([torch.ops.glassbox.ggml_mm(x[i : i + 1], raw, qtype) for i in range(7)])
    assert torch.equal(together, alone)


@pytest.mark.parametrize(
    ("flags", "rows"),
    [({"avx2", "avx512f", "avx512_bf16"}, 16), ({"avx2", "avx512f", "avx512_vnni"}, 32)],
)
def test_float32_panels_take_over_from_more_rows_than_bf16_ones(monkeypatch, flags, rows):
    monkeypatch.setattr(ggml_kernel, "cpu_flags", lambda: frozenset(flags))
    ggml_kernel.dense_dtype.cache_clear()
    try:
        assert quant.dense_rows() == rows
    finally:
        ggml_kernel.dense_dtype.cache_clear()


@pytest.mark.parametrize("qtype", [quant.Q4_1, quant.Q4_K])
def test_the_requantised_head_is_within_half_its_own_step_of_its_weights(qtype):
    """The lm_head's bulk requantised to Q4_1 or Q4_K, read back by gguf's own dequantize: each
    value within half a step of its block, and a step near range/15 of its 32 values."""
    weight = torch.randn(64, 512, generator=torch.Generator().manual_seed(qtype)) * 0.05
    weight[3, 7] = 0.9  # an outlier: its block's step is wide, the others' are not
    linear = quant.GGMLLinear.requantized(weight, qtype)
    assert linear.qtype == qtype
    assert (
        linear.nbytes
        == 64 * 512 // ggml_blocks.BLOCK_VALUES[qtype] * ggml_blocks.BLOCK_BYTES[qtype]
    )
    _, scale, _ = ggml_blocks.unpack(linear.raw, qtype)  # each block's own step
    error = (reference(linear.raw, qtype) - weight).abs().reshape(64, -1, 32)
    assert (error <= scale[..., None] / 2 * (1 + 1e-3) + 1e-7).all()
    groups = weight.reshape(64, -1, 32)
    spread = (groups.amax(-1) - groups.amin(-1)) / 15
    assert (scale < 1.25 * spread + 1e-3).all()  # the 6-bit scales cost little


def test_a_fast_model_holds_the_files_blocks_and_follows_the_exact_model(tmp_path, monkeypatch):
    """Q4_K q/k (one product), Q6_K v, Q5_0 gate and Q8_0 up (two products), a Q5_K output
    (no GGML kernel: torch's int4 halves), Q6_K down: each run of one type the kernels read
    is one GGML product, at the file's size; logits of a prefill and of steps through the
    cache follow the exact model's."""
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "all")
    file = GGUFFile(mixed_gguf(tmp_path / "mixed.gguf", Q6_K))
    fast = fast_builder.build_fast(file)
    block = fast.blocks[0]
    q_k, v = block.attention.qkv.linears()
    assert isinstance(q_k, quant.GGMLLinear) and q_k.qtype == quant.Q4_K
    assert q_k.out_features == 256 + 128
    assert isinstance(v, quant.GGMLLinear) and v.qtype == quant.Q6_K
    assert v.nbytes == file.tensors["blk.0.attn_v.weight"].nbytes  # the file's size
    gate, up = block.feed_forward.gate_up.linears()
    assert isinstance(gate, quant.GGMLLinear) and gate.qtype == quant.Q5_0
    assert isinstance(up, quant.GGMLLinear) and up.qtype == quant.Q8_0
    assert isinstance(block.feed_forward.down, quant.GGMLLinear)
    assert isinstance(block.attention.out, quant.Int4Linear)  # Q5_K: torch's int4 halves
    assert isinstance(fast.output.bulk, quant.GGMLLinear)  # the Q6_K head requantised
    assert fast.output.bulk.qtype == quant.Q4_K  # 4.5 bits a value (its top logits: exact)
    if compiled._package_loader() is not None:  # else it refuses for the torch
        assert compiled.refusal(fast) is None

    exact = build_exact(file, torch.float32)
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = exact(ids).logits[0]
    assert_follows_logits(fast, ids, expected, expected.abs().max() * 0.1, prefill=9)


@pytest.mark.parametrize("capability", ["AVX2", "AVX512"])
def test_which_types_the_kernels_hold_under_each_kernel_set(capability, monkeypatch):
    """Every type they read under AVX2 (where torch's int4 kernel is slow), the K-quants and
    Q8_0 under AVX-512; all of them when asked."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    held = [t for t in ggml_kernel.TYPES if ggml_kernel.holds(t)]
    avx512 = [quant.Q5_0, quant.Q8_0, quant.Q4_K, quant.Q6_K]  # not Q4_0/Q4_1: torch's is faster
    assert held == (list(ggml_kernel.TYPES) if capability == "AVX2" else avx512)
    assert not ggml_kernel.holds(quant.Q5_K)  # no kernel for it
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "all")
    assert [t for t in ggml_kernel.TYPES if ggml_kernel.holds(t)] == list(ggml_kernel.TYPES)


def test_turned_off_the_weights_take_torchs_int4_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "0")
    assert not ggml_kernel.in_use()
    fast = fast_builder.build_fast(GGUFFile(mixed_gguf(tmp_path / "mixed.gguf", Q6_K)))
    assert not any(isinstance(m, quant.GGMLLinear) for m in fast.modules())


def test_a_build_that_fails_is_a_reason_not_a_crash(tmp_path, monkeypatch):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(ggml_kernel, "SOURCE", broken)
    reason = ggml_kernel._load(ggml_kernel.library_path(tmp_path))
    assert reason is not None and reason.startswith("the kernels did not build or load")
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left
    assert not list((tmp_path / "kernels").glob("*.partial"))


def test_a_build_removes_the_libraries_of_older_sources(tmp_path):
    folder = tmp_path / "kernels"
    folder.mkdir()
    older = [
        folder / "ggml_dot-torch1.0-aaaaaaaaaaaa.so",  # named before the kernel sets
        folder / "ggml_dot-torch1.0-aaaaaaaaaaaa.so.lock",
        folder / "ggml_dot-vnni-torch1.0-aaaaaaaaaaaa.so",
    ]
    for path in older:
        path.write_bytes(b"old")
    other = folder / "notes.txt"  # not ours: kept
    other.write_text("kept")
    other_set = folder / "ggml_dot-avx2-torch1.0-bbbbbbbbbbbb.so"  # a forced AVX2 run's: kept
    other_set.write_bytes(b"other")
    path = ggml_kernel.library_path(tmp_path, "vnni")  # as a build just made it (not loaded:
    path.write_bytes(b"new")  # a second library of the same ops would abort the process)
    ggml_kernel._remove_older(path)
    assert path.is_file() and other.is_file() and other_set.is_file()
    assert not any(p.exists() for p in older)


def test_each_kernel_set_names_its_own_library(tmp_path):
    avx2, vnni = (ggml_kernel.library_path(tmp_path, k) for k in ggml_kernel.KERNEL_SETS)
    assert avx2 != vnni and avx2.name.startswith("ggml_dot-avx2-")
    assert ggml_kernel._kernels_of(vnni) == "vnni"
    assert set(ggml_kernel.VNNI_FLAGS) <= set(ggml_kernel.flags("vnni"))
    assert not set(ggml_kernel.VNNI_FLAGS) & set(ggml_kernel.flags("avx2"))


@pytest.mark.parametrize(
    ("capability", "cpu", "expected"),
    [
        ("AVX512", ggml_kernel.VNNI_CPU_FLAGS | {"avx2"}, "vnni"),
        ("AVX2", ggml_kernel.VNNI_CPU_FLAGS | {"avx2"}, "avx2"),  # ATEN_CPU_CAPABILITY=avx2
        ("AVX512", {"avx512f", "avx512bw", "avx512vl", "avx2"}, "avx2"),  # no VNNI
    ],
)
def test_the_kernel_set_follows_torchs_and_the_cpus(capability, cpu, expected, monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(ggml_kernel, "cpu_flags", lambda: frozenset(cpu))
    assert ggml_kernel.kernel_set() == expected


def test_a_vnni_build_that_fails_falls_back_to_the_avx2_form(monkeypatch, tmp_path):
    """A compiler without AVX-512 VNNI: the kernels still run, in their AVX2 form."""
    tried: list[str] = []

    def load(path):
        tried.append(ggml_kernel._kernels_of(path))
        return "the kernels did not build or load: no vnni" if tried[-1] == "vnni" else None

    monkeypatch.setattr(ggml_kernel, "_state", {})
    monkeypatch.setattr(ggml_kernel, "kernel_set", lambda: "vnni")
    monkeypatch.setattr(ggml_kernel, "_load", load)
    monkeypatch.setattr(ggml_kernel, "default_cache_dir", lambda: tmp_path)
    assert ggml_kernel.ensure() is None
    assert tried == ["vnni", "avx2"]


# Run under ATEN_CPU_CAPABILITY=avx2: the AVX2 form's products of the saved inputs
AVX2_PRODUCTS = """
import sys, torch
from engine.weights import ggml_kernel
assert ggml_kernel.kernel_set() == "avx2" and ggml_kernel.ensure() is None
cases = torch.load(sys.argv[1])
torch.save([torch.ops.glassbox.ggml_mm(x, raw, qtype) for qtype, raw, x in cases], sys.argv[2])
"""


@pytest.mark.skipif(ggml_kernel.kernel_set() != "vnni", reason="no AVX-512 VNNI form here")
def test_the_vnni_form_gives_the_avx2_forms_products_bit_for_bit(tmp_path):
    """Its instructions add the same integer products as AVX2's, in the same order."""
    generator = torch.Generator().manual_seed(7)
    cases = [
        (qtype, random_blocks(qtype, 40, 768, seed=qtype), torch.randn(3, 768, generator=generator))
        for qtype in TYPES
    ]  # fmt: skip
    torch.save(cases, tmp_path / "cases.pt")
    root = str(Path(__file__).parents[3])
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": root}
    script = [sys.executable, "-c", AVX2_PRODUCTS]
    subprocess.run(
        [*script, str(tmp_path / "cases.pt"), str(tmp_path / "avx2.pt")],
        check=True,
        env=env,
        timeout=600,
    )
    avx2 = torch.load(tmp_path / "avx2.pt")
    for (qtype, raw, x), theirs in zip(cases, avx2, strict=True):
        assert torch.equal(torch.ops.glassbox.ggml_mm(x, raw, qtype), theirs), qtype


def test_a_changed_header_names_a_new_library(tmp_path, monkeypatch):
    """The library is named by every source the .cpp includes: a kernel changed in a header
    is built anew, never served by the library of the old one."""
    sources = tmp_path / "kernels_src"
    shutil.copytree(ggml_kernel.SOURCE.parent, sources)
    monkeypatch.setattr(ggml_kernel, "SOURCE", sources / ggml_kernel.SOURCE.name)
    before = ggml_kernel.library_path(tmp_path)
    assert before == ggml_kernel.library_path(tmp_path)  # the same sources, the same name
    header = sources / "ggml_dense.h"
    header.write_text(header.read_text() + "// changed\n")
    assert ggml_kernel.library_path(tmp_path) != before


def test_no_compiler_is_a_reason(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    assert "no C++ compiler" in str(ggml_kernel._refusal())


@pytest.mark.parametrize(
    ("heads", "group", "d", "length"),
    [(3, 3, 64, 1), (3, 3, 64, 700), (2, 6, 128, 257), (1, 4, 256, 9)],
)
def test_attend_one_is_the_softmax_over_the_cache_it_is_given(heads, group, d, length):
    """One query per head against a view of a bf16 cache (keys in tasks of 256, their partial
    softmaxes combined), against float64 attention on the same bf16 numbers."""
    generator = torch.Generator().manual_seed(length)
    cache = torch.randn(2, 1, heads, 768, d, generator=generator).to(torch.bfloat16)
    k, v = cache[0, 0, :, :length], cache[1, 0, :, :length]  # strided as the step's views
    q = (torch.randn(heads, group, d, generator=generator) * 3).to(torch.bfloat16)
    scores = q.double() @ k.double().transpose(1, 2) / d**0.5
    expected = scores.softmax(-1) @ v.double()
    ours = torch.ops.glassbox.attend_one(q, k, v)
    assert ours.dtype == torch.float32 and ours.shape == (heads, group, d)
    torch.testing.assert_close(ours.double(), expected, rtol=0, atol=2e-6)


def test_attend_one_refuses_a_cache_it_cannot_read():
    k = torch.randn(2, 10, 64).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="a bf16 cache"):
        torch.ops.glassbox.attend_one(torch.randn(2, 3, 64), k.float(), k.float())
    with pytest.raises(RuntimeError, match="shapes do not match"):
        torch.ops.glassbox.attend_one(torch.randn(2, 3, 32), k, k)
