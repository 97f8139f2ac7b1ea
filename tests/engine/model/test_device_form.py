"""The GPU's form of a fast model built from the file's own blocks (fast_builder's
`device_blocks`, to_device): every weight dequantised once, on the device (the CPU here),
exactly as the numpy reference dequantises it, and decoding as the form built from int4."""

from __future__ import annotations

import pytest
import torch

from engine.gguf import blocks
from engine.gguf.reader import GGUFFile
from engine.model.fast_builder import build_fast
from engine.model.gguf_shape import raw_rows, read_shape
from engine.model.layer import rope_matrix_rows
from engine.model.to_device import to_device
from engine.weights.ggml_linear import GGMLLinear
from tests.engine.measure.test_accelerator import DEVICES
from tests.engine.model.test_fast import hf_model
from tests.gguf_files import F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, write_gguf

TYPES = {"attn_v.weight": Q5_0, "attn_output.weight": Q5_1, "ffn_down.weight": Q4_0}
CPU = torch.device("cpu")


def written(tmp_path):
    return GGUFFile(write_gguf(tmp_path / "llama.gguf", hf_model("llama"), Q4_1, Q8_0, TYPES))


def dequantized(file: GGUFFile, *names: str) -> torch.Tensor:
    """The named tensors' rows (in the model's row order) by the numpy reference, float32."""
    shape = read_shape(file)
    return torch.cat(
        [blocks.dequantize(raw_rows(file, shape, n), file.tensors[n].type) for n in names]
    )


def test_the_files_blocks_are_kept_until_the_device_dequantises_them(tmp_path):
    file = written(tmp_path)
    model = build_fast(file, kernels=False, device_blocks=True)
    attention = model.blocks[0].attention
    assert [type(p) for p in attention.qkv.linears()] == [GGMLLinear, GGMLLinear]  # q+k, v
    assert type(model.output.bulk) is GGMLLinear


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "mps"])
def test_every_weight_is_the_reference_dequantised_once_to_bf16(tmp_path, device):
    file = written(tmp_path)
    model = to_device(build_fast(file, kernels=False, device_blocks=True), torch.device(device))
    model = model.to(CPU)  # compared here, bit for bit
    for i, module in enumerate(model.blocks):
        block, p = module, f"blk.{i}."
        want = {
            block.attention.qkv: dequantized(
                file, p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"
            ),
            block.attention.out: dequantized(file, p + "attn_output.weight"),
            block.feed_forward.gate_up: dequantized(
                file, p + "ffn_gate.weight", p + "ffn_up.weight"
            ),
            block.feed_forward.down: dequantized(file, p + "ffn_down.weight"),
        }
        for linear, weight in want.items():
            assert torch.equal(linear.weight, weight.to(torch.bfloat16))
    table = dequantized(file, "token_embd.weight")
    assert torch.equal(model.embedding.rows, table)  # float32, exactly
    assert "output.weight" in file.tensors  # untied: the head's exact rows a table of its own
    assert torch.equal(model.output.rows, dequantized(file, "output.weight"))
    assert torch.equal(model.output.bulk.weight, model.output.rows.to(torch.bfloat16))
    # a GPU's one-token passes rotate elementwise, fused into the compiled step's kernels
    assert model.rope_matrix_rows == rope_matrix_rows(torch.device(device))


def test_a_head_of_a_type_without_blocks_is_its_rows_in_bf16(tmp_path):
    f16 = write_gguf(tmp_path / "f16.gguf", hf_model("llama"), Q4_1, Q8_0, {"output.weight": F16})
    file = GGUFFile(f16)
    model = to_device(build_fast(file, kernels=False, device_blocks=True), CPU)
    rows = torch.from_numpy(file.raw("output.weight").copy()).view(torch.float16).float()
    assert torch.equal(model.output.rows, rows.view(model.output.rows.shape))
    assert torch.equal(model.output.bulk.weight, model.output.rows.to(torch.bfloat16))


def test_a_tied_head_shares_the_embeddings_table(tmp_path):
    model = hf_model("qwen2")
    model.config.tie_word_embeddings = True  # written without output.weight, as Qwen's files
    file = GGUFFile(write_gguf(tmp_path / "qwen2.gguf", model, Q4_1, Q8_0))
    assert "output.weight" not in file.tensors
    fast = to_device(build_fast(file, kernels=False, device_blocks=True), CPU)
    assert fast.output.rows is fast.embedding.rows


def test_it_decodes_as_the_form_built_from_int4(tmp_path):
    file = written(tmp_path)
    blocks_form = to_device(build_fast(file, kernels=False, device_blocks=True), CPU)
    int4_form = to_device(build_fast(file, kernels=False), CPU)
    ids = torch.arange(3, 11)[None]
    want = int4_form.forward(ids, int4_form.new_cache(), None)
    got = blocks_form.forward(ids, blocks_form.new_cache(), None)
    # the same values where int4 holds them exactly (Q4_0/Q4_1); Q5 and Q8 parts were split
    # into int4 halves there, whose sums round otherwise
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)
    assert got.argmax() == want.argmax()
