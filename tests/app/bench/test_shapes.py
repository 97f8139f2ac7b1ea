"""The random-weight model shapes (app/bench/shapes.py): the real files' layouts, pinned here
and compared with the real files where they are present, and models both paths run."""

from __future__ import annotations

import argparse
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from app.bench.command import model_shape
from app.bench.random_blocks import SCALE_FIELDS, random_blocks
from app.bench.shapes import (
    SHAPES,
    TEMPLATES,
    Shape,
    layout,
    metadata,
    shape_file,
    shape_named,
    write,
)
from engine.gguf.blocks import Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0, dequantize
from engine.gguf.reader import GGUFFile

F32 = 0
QWEN_MORE = [0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27]
GEMMA_MORE = [0, 1, 4, 7, 10, 13, 15, 16, 17]


# Each real file's tensors: (name or per-layer suffix, numpy shape, type) -> how many
PINNED = {
    "bundled": {
        ("token_embd.weight", (49152, 576), Q8_0): 1,
        ("output_norm.weight", (576,), F32): 1,
        ("attn_q.weight", (576, 576), Q4_1): 30,
        ("attn_k.weight", (192, 576), Q4_1): 30,
        ("attn_v.weight", (192, 576), Q4_1): 30,
        ("attn_output.weight", (576, 576), Q4_1): 30,
        ("ffn_gate.weight", (1536, 576), Q4_1): 30,
        ("ffn_up.weight", (1536, 576), Q4_1): 30,
        ("ffn_down.weight", (576, 1536), Q4_1): 30,
        ("attn_norm.weight", (576,), F32): 30,
        ("ffn_norm.weight", (576,), F32): 30,
    },
    "qwen2.5-1.5b": {
        ("token_embd.weight", (151936, 1536), Q4_K): 1,
        ("output.weight", (151936, 1536), Q6_K): 1,
        ("output_norm.weight", (1536,), F32): 1,
        ("attn_q.weight", (1536, 1536), Q4_K): 28,
        ("attn_k.weight", (256, 1536), Q4_K): 28,
        ("attn_v.weight", (256, 1536), Q4_K): 14,
        ("attn_v.weight", (256, 1536), Q6_K): 14,
        ("attn_output.weight", (1536, 1536), Q4_K): 28,
        ("ffn_gate.weight", (8960, 1536), Q4_K): 28,
        ("ffn_up.weight", (8960, 1536), Q4_K): 28,
        ("ffn_down.weight", (1536, 8960), Q4_K): 14,
        ("ffn_down.weight", (1536, 8960), Q6_K): 14,
        ("attn_q.bias", (1536,), F32): 28,
        ("attn_k.bias", (256,), F32): 28,
        ("attn_v.bias", (256,), F32): 28,
        ("attn_norm.weight", (1536,), F32): 28,
        ("ffn_norm.weight", (1536,), F32): 28,
    },
    "gemma-3-270m": {
        ("token_embd.weight", (262144, 640), Q8_0): 1,
        ("output_norm.weight", (640,), F32): 1,
        ("attn_q.weight", (1024, 640), Q5_0): 18,
        ("attn_k.weight", (256, 640), Q5_0): 18,
        ("attn_v.weight", (256, 640), Q5_0): 9,
        ("attn_v.weight", (256, 640), Q8_0): 9,
        ("attn_output.weight", (640, 1024), Q4_K): 18,
        ("ffn_gate.weight", (2048, 640), Q5_0): 18,
        ("ffn_up.weight", (2048, 640), Q5_0): 18,
        ("ffn_down.weight", (640, 2048), Q4_K): 9,
        ("ffn_down.weight", (640, 2048), Q6_K): 9,
        ("attn_q_norm.weight", (256,), F32): 18,
        ("attn_k_norm.weight", (256,), F32): 18,
        ("attn_norm.weight", (640,), F32): 18,
        ("ffn_norm.weight", (640,), F32): 18,
        ("post_attention_norm.weight", (640,), F32): 18,
        ("post_ffw_norm.weight", (640,), F32): 18,
    },
}
# The layers whose attn_v / ffn_down get more bits (Q4_K_M's rule, as each file has it)
MORE_BITS = {
    "qwen2.5-1.5b": {"attn_v.weight": QWEN_MORE, "ffn_down.weight": QWEN_MORE},
    "gemma-3-270m": {"attn_v.weight": GEMMA_MORE, "ffn_down.weight": GEMMA_MORE},
}


def summary(tensors: dict[str, tuple[tuple[int, ...], int]]) -> Counter:
    return Counter((name.split(".", 2)[-1] if name.startswith("blk.") else name, shape, qtype)
                   for name, (shape, qtype) in tensors.items())  # fmt: skip


def upgraded_layers(tensors: dict[str, tuple[tuple[int, ...], int]], suffix: str) -> list[int]:
    """The layers whose `suffix` tensor has a type other than layer 2's (never upgraded)."""
    plain = tensors[f"blk.2.{suffix}"][1]
    named = (name for name in tensors if name.startswith("blk.") and name.endswith(suffix))
    return sorted(int(name.split(".")[1]) for name in named if tensors[name][1] != plain)


def file_layout(path: Path) -> dict[str, tuple[tuple[int, ...], int]]:
    file = GGUFFile(path)
    try:
        return {name: (info.shape, info.type) for name, info in file.tensors.items()}
    finally:
        file.close()


def real_file(shape: Shape, request: pytest.FixtureRequest) -> Path:
    """The real GGUF of `shape`, or a skip saying why it is absent."""
    if shape.name == "bundled":
        from engine.load.loader import ModelLoadError, bundled_gguf_path

        try:
            return bundled_gguf_path()
        except ModelLoadError as error:
            pytest.skip(str(error))
    fixture = {"qwen2.5-1.5b": "real_qwen", "gemma-3-270m": "real_gemma"}[shape.name]
    path: Path = request.getfixturevalue(fixture)  # skips where it was not fetched
    assert path.name == shape.real_file
    return path


@pytest.mark.parametrize("name", SHAPES)
def test_each_shapes_layout_is_the_pinned_real_layout(name):
    tensors = layout(SHAPES[name])
    assert summary(tensors) == Counter(PINNED[name])
    for suffix, layers in MORE_BITS.get(name, {}).items():
        assert upgraded_layers(tensors, suffix) == layers


@pytest.mark.parametrize("name", SHAPES)
def test_each_shapes_layout_and_metadata_are_the_real_files(name, request):
    shape = SHAPES[name]
    path = real_file(shape, request)
    assert layout(shape) == file_layout(path)
    file = GGUFFile(path)
    try:
        arch = shape.architecture
        assert file.get("general.architecture") == arch
        assert file.get(f"{arch}.block_count") == shape.layers
        for key, value in shape.metadata.items():
            assert file.get(f"{arch}.{key}") == pytest.approx(value), key
        tokens = file.get("tokenizer.ggml.tokens")
        assert len(tokens) == shape.vocab
        assert {i: tokens[i] for i in shape.tokenizer.special} == shape.tokenizer.special
        assert file.get("tokenizer.ggml.model") == shape.tokenizer.model
        for key, token_id in shape.tokenizer.ids.items():
            assert file.get(f"tokenizer.ggml.{key}_token_id") == token_id
        for key, flag in shape.tokenizer.flags.items():
            assert file.get(f"tokenizer.ggml.{key}") is flag, key
        if shape.tokenizer.byte_tokens_at:
            assert tokens[shape.tokenizer.byte_tokens_at] == "<0x00>"
        template = file.get("tokenizer.chat_template")
        pinned = Path("app/bench/templates", shape.chat_template)
        assert template == (pinned.read_text() if shape.chat_template else None)
        assert bool(file.get("general.finetune")) == bool(shape.finetune)
        read = {key for key in file.metadata if key.startswith((f"{arch}.", "tokenizer."))}
        assert read == {key for key in metadata(shape) if not key.startswith("general.")}
    finally:
        file.close()


@pytest.mark.parametrize("name", ["bundled", "gemma-3-270m"])  # Qwen's is 1.1 GB to write
def test_a_built_file_has_the_layout_and_is_written_once(name, shapes_cache):
    shape = SHAPES[name]
    path = shape_file(shape, shapes_cache)
    assert file_layout(path) == layout(shape)
    file = GGUFFile(path)
    try:
        assert len(file.get("tokenizer.ggml.tokens")) == shape.vocab
        assert file.get(f"{shape.architecture}.context_length") == shape.metadata["context_length"]
    finally:
        file.close()
    written = path.stat().st_mtime_ns
    assert shape_file(shape, shapes_cache) == path
    assert path.stat().st_mtime_ns == written
    assert not list(path.parent.glob("*.partial"))


@pytest.mark.parametrize("qtype", sorted(SCALE_FIELDS))
def test_random_blocks_give_weights_of_about_the_asked_size(qtype):
    raw = random_blocks(64, 512, qtype, std=0.02, seed=1)
    weights = dequantize(torch.from_numpy(raw), qtype).numpy()
    assert weights.shape == (64, 512)
    assert np.isfinite(weights).all()
    assert 0.005 < weights.std() < 0.08
    # K-quants' random 6-bit minimums do not cancel their scales: a mean offset under std
    assert abs(weights.mean()) < (0.03 if qtype in (Q4_K, Q5_K) else 0.005)


def test_a_shape_name_is_resolved_and_an_unknown_one_refused(shapes_cache, monkeypatch):
    monkeypatch.setenv("GLASSBOX_CACHE_DIR", str(shapes_cache))
    assert shape_named("bundled") is None  # the real bundled model, not its shape
    with pytest.raises(ValueError, match=r"known: bundled, qwen2\.5-1\.5b, gemma-3-270m"):
        shape_named("shape:llama-70b")
    args = argparse.Namespace(model="shape:bundled")
    assert model_shape(args) == "bundled"
    assert Path(args.model) == shape_file(SHAPES["bundled"], shapes_cache)


@pytest.mark.parametrize("precision", ["fast", "exact"])
def test_both_paths_load_a_shape_and_decode_greedy_tokens(request, precision):
    from engine.events import Finished
    from engine.generate.session import ChatSession
    from engine.settings import GenerationSettings, Message

    loaded = request.getfixturevalue(f"bundled_shape_{precision}")
    assert (loaded.info.layers, loaded.info.vocab_size, loaded.info.precision) == (
        30, 49152, precision,
    )  # fmt: skip
    assert loaded.info.chat_format == "own"  # SmolLM2's template, over the turn tokens
    im_start = loaded.tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start == 1  # a control token of the stand-in, kept whole in the prompt
    settings = GenerationSettings(max_new_tokens=3, greedy=True, ignore_eos=True)
    *_, finished = ChatSession(loaded).generate([Message("user", "hello there")], settings)
    assert isinstance(finished, Finished)
    assert finished.generated_tokens == 3
    assert finished.prompt_tokens > 5


def test_the_bench_refuses_an_unknown_shape_in_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "app", "bench", "--model", "shape:llama-70b", "--fast-only"],
        capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "GLASSBOX_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "glassbox bench: no model shape 'llama-70b';"
        " known: bundled, qwen2.5-1.5b, gemma-3-270m, loop"
    ]
    assert not (tmp_path / "shapes").exists()


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("lean", [False, True], ids=["transformers", "lean"])
def test_each_stand_in_tokenizer_loads_with_the_vocabulary_and_turn_tokens(name, lean, tmp_path):
    from engine.load.loader import gguf_tokenizer, instruction_tuned

    shape = SHAPES[name]
    path = tmp_path / f"{name}.gguf"
    write(shape, path, with_tensors=False)
    tokenizer = gguf_tokenizer(path, tmp_path, lambda stage, done: None, lean=lean)
    assert len(tokenizer) == shape.vocab
    for token_id, token in shape.tokenizer.special.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id
    assert tokenizer.eos_token_id == shape.tokenizer.ids["eos"]
    assert instruction_tuned(path) == bool(shape.finetune)
    if shape.chat_template:
        assert tokenizer.chat_template == (TEMPLATES / shape.chat_template).read_text()
    else:  # Gemma's file has none; a base model gets the plain transcript
        assert tokenizer.chat_template is None
    turn = "<|im_start|>" if shape.tokenizer.model == "gpt2" else "<start_of_turn>"
    ids = tokenizer(f"{turn}user\nhello there", add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids(turn)  # kept whole
    assert tokenizer.decode(ids[1:]) == "user\nhello there"
