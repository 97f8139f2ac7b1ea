"""Gemma 3 in the own model against the transformers Gemma3ForCausalLM built from the same tiny
GGUF: seven layers, the sixth global and the rest sliding (llama.cpp's pattern) with a window of
8 keys, shorter than every sequence here, so the window, both RoPE bases, the QK-norm and the
four norms a block (random, so their 1 + w matters) all show in the numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import engine.model.gemma
from engine.generate.session import ChatSession
from engine.gguf.reader import GGUFFile
from engine.load.loader import LoadedModel, describe_fast
from engine.model import fast_builder, gguf_shape, reference
from engine.model.attention_probe import AttentionProbe
from engine.model.gemma import GGUFGemma
from engine.model.kv_buffer import WindowedKVBuffer
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.engine.model.test_fast import assert_follows_logits, assert_kv_bytes_follow_the_formula
from tests.gguf_files import F32, Q4_1, write_gguf
from tests.models import tiny_config

LAYERS = 7
WINDOW = 8
SLIDING = (0, 1, 2, 3, 4, 6)  # every sixth layer is global
LENGTH = 24  # positions teacher-forced: three windows
QUESTION = [Message("user", "Why is the sky blue? Answer briefly.")]


def gemma(seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    kinds = ["sliding_attention" if i in SLIDING else "full_attention" for i in range(LAYERS)]
    config = tiny_config("gemma3", num_hidden_layers=LAYERS, layer_types=kinds,
                         sliding_window=WINDOW, query_pre_attn_scalar=16)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma's norms start at w = 0 (a scale of 1): make them matter
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.normal_(0.0, 0.1)
    return model


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(the transformers model, a GGUF of it in Q4_1: the lm_head repacked as it is, not
    requantised, so the logits are compared whole as in test_fast)."""
    model = gemma()
    path = tmp_path_factory.mktemp("gemma") / "gemma3.gguf"
    return model, write_gguf(path, model, Q4_1, Q4_1)


@pytest.fixture(scope="module")
def models(written):
    """(exact, fast) models of the same file."""
    file = GGUFFile(written[1])
    return reference.build_exact(file, torch.float32), fast_builder.build_fast(file)


def test_shape_reads_llama_cpps_layer_pattern_and_scale(written):
    shape = gguf_shape.read_shape(GGUFFile(written[1]))
    assert shape.architecture == "gemma3"
    assert shape.sliding_layers == SLIDING and shape.sliding_window == WINDOW
    assert (shape.rope_base, shape.local_rope_base) == (1e6, 1e4)
    assert shape.query_scale == 16**-0.5


def test_exact_model_from_a_lossless_gguf_equals_the_original(tmp_path):
    """F32 tensors: transformers' model rebuilt from the file is the original (its norms
    stored as 1 + w and read back as w)."""
    original = gemma()
    path = write_gguf(tmp_path / "f.gguf", original, F32, F32)
    rebuilt = reference.build_exact(GGUFFile(path), torch.float32)
    ids = torch.randint(0, 49152, (1, LENGTH))
    with torch.inference_mode():
        torch.testing.assert_close(rebuilt(ids).logits, original(ids).logits, rtol=0, atol=1e-5)


def test_fast_model_follows_the_exact_model_of_the_same_file(models):
    """Teacher-forced over three windows, whole and then one token at a time through the
    cache, within test_fast's tolerance for Q4 weights."""
    exact, fast = models
    assert isinstance(fast, GGUFGemma)
    ids = torch.randint(0, 49152, (1, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = exact(ids).logits[0]
    # test_fast's 2% for Q4 weights; Gemma rounds to bf16 more often (four norms and the
    # QK-norm a block): an F32-weight file alone measured 1.5-1.9% here
    scale = expected.abs().max() * 0.03
    cache = assert_follows_logits(fast, ids, expected, scale, prefill=5)
    # a second prompt after cached positions: a window mask that starts mid-sequence
    cache.truncate(10)
    longer = fast.forward(ids[:, 10:], cache, None, every_position=True)
    assert (longer - expected[10:]).abs().max() < scale


def test_greedy_tokens_equal_generate_on_the_exact_model(models):
    exact, fast = models
    prompt = torch.randint(0, 49152, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        expected = exact.generate(prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    cache, tokens = fast.new_cache(), []
    logits = fast.forward(prompt, cache, None)
    for _ in range(12):
        tokens.append(int(logits.argmax()))
        logits = fast.forward(torch.tensor([[tokens[-1]]]), cache, None)
    assert tokens == expected[0, 6:].tolist()


@pytest.fixture
def eager(monkeypatch):
    """Swaps a plain eager attention in for SDPA: float32, its own causal and window masks from
    the positions (the keys it is given are the last ones before the pass's end). Returns the
    weights of every call, in layer order; the probe sees the same q and k."""
    captured: list[torch.Tensor] = []

    def attend(q, k, v, start, window, scale):
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1).float()
        v = v.repeat_interleave(groups, dim=1).float()
        scores = q.float() @ k.transpose(-1, -2) * scale
        end = start + q.shape[2]
        query = torch.arange(start, end)[:, None]
        key = torch.arange(end - k.shape[2], end)[None, :]
        allowed = (key <= query) & (query - key < (window or end + 1))
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        captured.append(weights[0])
        return (weights @ v).to(q.dtype)

    monkeypatch.setattr(engine.model.gemma, "attend_window", attend)
    return captured


def test_sliding_layer_attention_equals_an_eager_attention(models, eager):
    """Every layer's probe against eager attention from the same q and k: the prompt's whole
    matrix (zero outside a sliding layer's window), then a decode step's row, which on a
    sliding layer covers its window (as transformers' rows do)."""
    _, fast = models
    ids = torch.randint(0, 49152, (1, LENGTH), generator=torch.Generator().manual_seed(3))
    every = frozenset(range(LAYERS))
    prompt = AttentionProbe(every, rows=LENGTH - 1)
    cache = fast.new_cache()
    fast.forward(ids[:, :-1], cache, prompt)
    for layer in range(LAYERS):
        torch.testing.assert_close(prompt.weights[layer], eager[layer], rtol=0, atol=1e-6)
    query = torch.arange(LENGTH - 1)[:, None]
    outside = torch.arange(LENGTH - 1)[None, :] <= query - WINDOW
    assert bool(outside.any())  # the test means nothing otherwise
    assert bool((prompt.weights[0][:, outside] == 0).all())
    assert bool((prompt.weights[5][:, outside] > 0).all())  # the global layer
    eager.clear()
    step = AttentionProbe(every)
    fast.forward(ids[:, -1:], cache, step)
    for layer in range(LAYERS):
        row = step.weights[layer][:, 0]
        assert row.shape[-1] == (WINDOW if layer in SLIDING else LENGTH)
        torch.testing.assert_close(row, eager[layer][:, 0], rtol=0, atol=1e-6)


def test_kv_bytes_are_the_cache_tensors_and_the_formula(written, tokenizer):
    """The session's KV numbers on the fast model: what the cache's tensors hold, and the
    panel's formula (sliding layers capped at their window)."""
    model = fast_builder.build_fast(GGUFFile(written[1]))
    info = describe_fast(model, "gemma3.gguf", "gguf")
    assert info.architecture == "GGUFGemma (gemma3)"
    assert (info.sliding_layers, info.sliding_window) == (SLIDING, WINDOW)
    session = ChatSession(LoadedModel(model, tokenizer, info))
    settings = GenerationSettings(greedy=True, max_new_tokens=8, ignore_eos=True)
    events = list(session.generate(QUESTION, settings, ProbeSettings(top_k=0)))
    prefill, tokens = assert_kv_bytes_follow_the_formula(events, info)
    assert prefill.prompt_tokens > WINDOW  # the test means nothing otherwise
    cache = session._cache
    held = cache.held_positions()
    measured = [
        k[:, :, :tokens_held].numel() * k.element_size() * 2
        for k, tokens_held in zip(cache.keys, held, strict=True)
    ]
    assert tuple(measured) == tokens[-1].kv_bytes_per_layer
    per_token = 2 * info.kv_heads * info.head_dim * info.bytes_per_value
    total = prefill.prompt_tokens + tokens[-1].index
    np.testing.assert_array_equal(
        np.array(tokens[-1].kv_bytes_per_layer) // per_token,
        [WINDOW - 1 if i in SLIDING else total for i in range(LAYERS)],
    )


def test_sliding_layers_hold_only_their_window_as_the_context_grows():
    """Small chunks, so the window's move to the front happens: the sliding layer's buffer
    stays bounded, its views are the positions its queries see, and a truncation past what it
    dropped is refused (the session then starts a new cache)."""
    cache = WindowedKVBuffer(2, 1, 4, torch.float32, torch.device("cpu"), sliding=(0,), window=5,
                             chunk=4)  # fmt: skip
    for position in range(40):
        cache.reserve(position + 1)
        step = torch.full((1, 1, 1, 4), float(position))
        seen = [cache.write(layer, position, step, step)[0][0, 0, :, 0] for layer in (0, 1)]
        cache.length = position + 1
        assert seen[0].tolist() == list(range(max(0, position - 4), position + 1))
        assert seen[1].tolist() == list(range(position + 1))
        assert cache.keys[0].shape[2] <= 5 - 1 + 2 * 4
    assert cache.held_positions() == (4, 40)
    assert cache.layer_bytes() == (4 * 2 * 4 * 4, 40 * 2 * 4 * 4)
    assert cache.truncate(38) and not cache.truncate(20)


def test_the_loader_gives_gemma_a_compiled_step(models, written, tmp_path, monkeypatch, caplog):
    """Gemma 3's layers are in the compiled step (tests/engine/step/test_compiled.py holds it to
    the eager steps): the loader refuses it nothing, and attaches one where one is kept."""
    from engine.load.gguf_fast import compile_in_background
    from engine.settings import LoadRequest
    from engine.step import compiled as compiled_decode

    monkeypatch.setenv("GLASSBOX_COMPILE", "1")
    _, fast = models
    assert fast.compile_refusal is None and compiled_decode.refusal(fast) is None
    request = LoadRequest(build_compiled=False)
    with caplog.at_level("INFO", logger="engine.load.gguf_fast"):
        assert compile_in_background(fast, written[1], tmp_path, request) is None
    assert "none is kept" in caplog.text  # not refused: no package built in this test
