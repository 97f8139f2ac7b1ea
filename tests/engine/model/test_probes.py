"""Every number the internals view shows, against an independent reference.

Attention: an eager forward with output_attentions=True over the whole final sequence.
KV bytes: the cache tensors' own sizes, and the formula. Top-k: softmax of reference logits.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from engine import kv_formula
from engine.events import PrefillDone, Token
from engine.generate.session import ChatSession
from engine.settings import FEWEST_ROWS, GenerationSettings, Message, ProbeSettings
from tests.models import make_tiny

QUESTION = [Message("user", "Why is the sky blue? Answer briefly.")]
STEPS = 12
SETTINGS = GenerationSettings(greedy=True, max_new_tokens=STEPS, ignore_eos=True)


def generate_with_probes(loaded, layers, messages=QUESTION, settings=SETTINGS, top_k=5):
    session = ChatSession(loaded)
    probes = ProbeSettings(attention_layers=layers, top_k=top_k)
    events = list(session.generate(messages, settings, probes))
    return session, events[0], [e for e in events if isinstance(e, Token)]


@torch.inference_mode()
def eager_reference(loaded, ids: list[int]):
    """Attention of every layer and logits at every position, from a plain eager forward."""
    eager = copy.deepcopy(loaded.model)
    eager.set_attn_implementation("eager")
    out = eager(torch.tensor([ids]), output_attentions=True, use_cache=False)
    return [a[0].float().numpy() for a in out.attentions], out.logits[0].float()


def test_attention_equals_eager_reference(tiny):
    layers = tuple(range(tiny.info.layers))
    _, prefill, tokens = generate_with_probes(tiny, layers)
    sequence = [*prefill.prompt_token_ids, *(t.token_id for t in tokens)]
    reference, _ = eager_reference(tiny, sequence)
    prompt = prefill.prompt_tokens
    for layer in layers:
        matrix = prefill.attention[layer]  # [heads, prompt, prompt]
        assert matrix.shape == (tiny.info.heads, prompt, prompt)
        np.testing.assert_allclose(matrix, reference[layer][:, :prompt, :prompt], atol=1e-5)
        np.testing.assert_allclose(matrix.sum(-1), 1.0, atol=1e-5)
        for token in tokens[1:]:
            query = prompt + token.index - 1  # the previous token produced this one
            row = token.attention[layer]  # [heads, keys]; a sliding layer sees its window
            expected = reference[layer][:, query, : query + 1]
            np.testing.assert_allclose(row, expected[:, -row.shape[1] :], atol=1e-5)
            np.testing.assert_allclose(expected[:, : -row.shape[1]], 0.0, atol=1e-6)
            np.testing.assert_allclose(row.sum(-1), 1.0, atol=1e-5)


def test_sliding_window_layer_rows_cover_only_the_window(tokenizer):
    loaded = make_tiny(tokenizer, "gemma3")
    _, prefill, tokens = generate_with_probes(loaded, (0, 1))
    window = loaded.info.sliding_window
    assert prefill.prompt_tokens > window  # the test means nothing otherwise
    assert tokens[-1].attention[0].shape[1] == window  # sliding layer
    assert tokens[-1].attention[1].shape[1] == prefill.prompt_tokens + STEPS - 1  # global


def test_prefill_keeps_only_the_last_rows_of_a_long_prompt(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    session = ChatSession(loaded)
    probes = ProbeSettings(attention_layers=(1,), prefill_rows=4)
    prefill = next(iter(session.generate(QUESTION, SETTINGS, probes)))
    reference, _ = eager_reference(loaded, list(prefill.prompt_token_ids))
    n = prefill.prompt_tokens
    assert prefill.attention[1].shape == (loaded.info.heads, 4, n)
    np.testing.assert_allclose(prefill.attention[1], reference[1][:, n - 4 :, :], atol=1e-5)


def test_a_cell_budget_keeps_fewer_prompt_rows_at_long_contexts(tokenizer):
    """rows x keys within prefill_cells: the last rows of the prompt, as the eager forward."""
    loaded = make_tiny(tokenizer, "llama")
    session = ChatSession(loaded)
    n = session.count_tokens(QUESTION)
    rows = FEWEST_ROWS + 2
    assert n > rows  # the test means nothing otherwise
    probes = ProbeSettings(attention_layers=(1,), prefill_rows=64, prefill_cells=rows * n + 5)
    prefill = next(iter(session.generate(QUESTION, SETTINGS, probes)))
    assert prefill.prompt_tokens == n
    assert prefill.attention[1].shape == (loaded.info.heads, rows, n)
    reference, _ = eager_reference(loaded, list(prefill.prompt_token_ids))
    np.testing.assert_allclose(prefill.attention[1], reference[1][:, n - rows :, :], atol=1e-5)


def test_kv_bytes_equal_the_tensors_and_the_formula(tiny):
    session, prefill, tokens = generate_with_probes(tiny, ())
    info = tiny.info
    per_token = 2 * info.kv_heads * info.head_dim * info.bytes_per_value
    assert prefill.kv_bytes == kv_formula.formula_bytes(info, prefill.prompt_tokens)
    if not info.sliding_layers:
        assert prefill.kv_bytes == info.layers * per_token * prefill.prompt_tokens
    for token in tokens:
        cached = prefill.prompt_tokens + max(token.index - 1, 0) + (token.index > 0)
        assert token.kv_bytes == kv_formula.formula_bytes(info, cached)
        assert sum(token.kv_bytes_per_layer) == token.kv_bytes
    measured = sum(
        layer.keys.numel() * layer.keys.element_size() * 2 for layer in session._cache.inner.layers
    )
    assert tokens[-1].kv_bytes == measured
    assert (
        kv_formula.mha_bytes(info, 10)
        == kv_formula.formula_bytes(info, 10) * info.heads // info.kv_heads
    )


@pytest.mark.bundled
def test_bundled_kv_formula_uses_the_models_numbers(bundled):
    info = bundled.info
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (30, 9, 3, 64)
    _, prefill, tokens = generate_with_probes(bundled, (0, 29), settings=GenerationSettings(
        greedy=True, max_new_tokens=4, ignore_eos=True))  # fmt: skip
    assert prefill.kv_bytes == 2 * 30 * 3 * 64 * prefill.prompt_tokens * 4
    assert tokens[-1].kv_bytes == 2 * 30 * 3 * 64 * (prefill.prompt_tokens + 3) * 4
    assert kv_formula.mha_bytes(info, 100) == 3 * kv_formula.formula_bytes(info, 100)


def test_top_k_equals_softmax_of_reference_logits(tiny):
    _, prefill, tokens = generate_with_probes(tiny, (), top_k=5)
    sequence = [*prefill.prompt_token_ids, *(t.token_id for t in tokens)]
    _, logits = eager_reference(tiny, sequence)
    for token in tokens:
        probs = torch.softmax(logits[prefill.prompt_tokens + token.index - 1], dim=-1)
        top = probs.topk(5)
        assert [c.token_id for c in token.top_k] == top.indices.tolist()
        np.testing.assert_allclose([c.prob for c in token.top_k], top.values.numpy(), atol=1e-5)
        assert token.top_k[0].token_id == token.token_id  # greedy picks the first
        assert token.top_k[0].sampled_prob == 1.0


def test_sampled_probabilities_follow_temperature_and_top_p(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    settings = GenerationSettings(max_new_tokens=6, temperature=0.5, top_k=0, top_p=0.8, seed=1)
    _, prefill, tokens = generate_with_probes(loaded, (), settings=settings, top_k=20)
    sequence = [*prefill.prompt_token_ids, *(t.token_id for t in tokens)]
    _, logits = eager_reference(loaded, sequence)
    for token in tokens:
        scaled = torch.softmax(logits[prefill.prompt_tokens + token.index - 1] / 0.5, dim=-1)
        ordered, _ = scaled.sort(descending=True)
        keep = int((ordered.cumsum(0) < 0.8).sum()) + 1  # smallest set reaching 0.8
        kept_mass = ordered[:keep].sum()
        for c in token.top_k:
            expected = (
                scaled[c.token_id] / kept_mass if scaled[c.token_id] >= ordered[keep - 1] else 0
            )
            assert c.sampled_prob == pytest.approx(float(expected), abs=1e-5)
        chosen = [c for c in token.top_k if c.token_id == token.token_id]
        assert all(c.sampled_prob > 0 for c in chosen)  # never draws a filtered-out token


def test_probes_do_not_change_the_tokens(tiny):
    _, _, watched = generate_with_probes(tiny, tuple(range(tiny.info.layers)), top_k=10)
    session = ChatSession(tiny)
    events = list(session.generate(QUESTION, SETTINGS, ProbeSettings.off()))
    plain = [e.token_id for e in events if isinstance(e, Token)]
    assert [t.token_id for t in watched] == plain
    assert all(not e.attention and not e.top_k for e in events if isinstance(e, Token))


def test_second_turn_prefill_attention_covers_new_rows_over_all_keys(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    session = ChatSession(loaded)
    probes = ProbeSettings(attention_layers=(0,))
    first = list(session.generate(QUESTION, SETTINGS, probes))
    history = [*QUESTION, Message("assistant", first[-1].text), Message("user", "More?")]
    prefill = next(iter(session.generate(history, SETTINGS, probes)))
    assert isinstance(prefill, PrefillDone) and prefill.reused_tokens > 0
    reference, _ = eager_reference(loaded, list(prefill.prompt_token_ids))
    new = prefill.processed_tokens
    assert prefill.attention[0].shape == (loaded.info.heads, new, prefill.prompt_tokens)
    np.testing.assert_allclose(prefill.attention[0], reference[0][:, -new:, :], atol=1e-5)
