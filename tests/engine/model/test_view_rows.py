"""The engine's side of the view's pull: per-head statistics computed where the model runs equal
the window's computation on the same rows; the ring of recent steps holds each step's rows as
the events carried them, within its byte cap; the trace keeps every step's rows."""

from __future__ import annotations

import types
from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.events import PrefillDone, Token
from engine.generate import head_stats
from engine.generate.head_stats import batch_statistics, prefill_statistics
from engine.generate.session import ChatSession
from engine.generate.trace import TraceRecorder
from engine.model.step_ring import ATTENTION, PROMPT, StepRing, host_rows
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.weights import ggml_kernel
from tests.models import make_tiny
from ui.panels.state.attention import row_stats

SETTINGS = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True)
HI = [Message("user", "Hi there, how are you?")]


def reply(session: ChatSession, probes: ProbeSettings) -> list:
    session.reset()
    return list(session.generate(HI, SETTINGS, probes))


def window_stats(block: np.ndarray) -> np.ndarray:
    """The window's old computation (ui.panels.state.attention.row_stats) as [2, heads, n]."""
    keys = block.shape[2]
    stats = row_stats(block, np.arange(keys - block.shape[1], keys))
    return np.stack([stats.max_weight, stats.entropy])


def test_head_statistics_equal_the_window_computation_on_random_rows():
    generator = torch.Generator().manual_seed(0)
    keys, rows = 50, 7
    scores = torch.randn(9, rows, keys, generator=generator)
    positions = torch.arange(keys - rows, keys)
    scores = scores.masked_fill(
        torch.arange(keys)[None, None, :] > positions[None, :, None], -torch.inf
    )
    block = torch.softmax(scores, dim=-1)
    engine = prefill_statistics({3: block})[3]
    np.testing.assert_allclose(engine, window_stats(block.numpy()), rtol=1e-5, atol=1e-6)
    one = batch_statistics([{3: block[:, -1], 5: block[:, -1, :20]}])[0][3]  # 5: sliding
    np.testing.assert_allclose(one, window_stats(block[:, -1:].numpy())[:, :, 0], rtol=1e-5)
    sliding = batch_statistics([{5: block[:, -1, :20]}])[0][5]
    np.testing.assert_allclose(
        sliding, window_stats(block[:, -1:, :20].numpy())[:, :, 0], rtol=1e-5
    )
    # several steps' rows of different lengths at once, as the session's batches take them
    steps = [{3: block[:, i, : keys - rows + i + 1], 5: block[:, i, :20]} for i in range(rows)]
    for i, stats in enumerate(batch_statistics([*steps[:2], {}, *steps[2:]])):
        if i == 2:
            assert stats == {}
            continue
        query = i if i < 2 else i - 1
        seen = keys - rows + query + 1  # the keys its query sees
        full = window_stats(block[:, query : query + 1, :seen].numpy())[:, :, 0]
        np.testing.assert_allclose(stats[3], full, rtol=1e-5, atol=1e-6)
        sliding = window_stats(block[:, query : query + 1, :20].numpy())[:, :, 0]
        np.testing.assert_allclose(stats[5], sliding, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
def test_the_kernels_head_statistics_are_the_torch_ways(monkeypatch):
    """The C++ op (where the GGML kernels load) and the rows padded into one block in torch:
    rows of many lengths (under eight keys too), strided views, one-hot and even rows."""
    generator = torch.Generator().manual_seed(1)
    rows = [
        torch.softmax(torch.randn(9, keys, generator=generator) * 3, -1) for keys in (1, 5, 8, 301)
    ]
    even, one_hot = torch.full((9, 40), 1 / 40), torch.zeros(9, 40)
    one_hot[:, 7] = 1.0
    strided = torch.softmax(torch.randn(40, 9, generator=generator), 0).T  # keys not contiguous
    steps = [{3: row} for row in (*rows, even, one_hot, strided)]
    ours = batch_statistics(steps)
    monkeypatch.setattr(head_stats, "ggml_kernel", types.SimpleNamespace(ensure=lambda: "off"))
    theirs = batch_statistics(steps)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(a[3], b[3], rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(ours[4][3][1], 1.0, rtol=1e-6)  # even: the largest entropy
    np.testing.assert_allclose(ours[5][3], [[1.0] * 9, [0.0] * 9], atol=1e-7)  # one-hot


@pytest.mark.parametrize("kind", ["llama", "gemma3"])  # gemma3: sliding-window layers
def test_a_model_reply_statistics_equal_the_window_computation_on_its_rows(tokenizer, kind):
    session = ChatSession(make_tiny(tokenizer, kind))
    events = reply(session, ProbeSettings(attention_layers=(0, 1), top_k=3))
    prefill = events[0]
    assert isinstance(prefill, PrefillDone)
    for layer, block in prefill.attention.items():
        np.testing.assert_allclose(
            prefill.head_stats[layer], window_stats(block), rtol=1e-5, atol=1e-6
        )
    tokens = [e for e in events if isinstance(e, Token)]
    assert not tokens[0].head_stats  # token 0's row is the prompt's last
    for token in tokens[1:]:
        assert set(token.head_stats) == {0, 1}
        for layer, row in token.attention.items():
            expected = window_stats(row[:, None, :])[:, :, 0]
            np.testing.assert_allclose(token.head_stats[layer], expected, rtol=1e-5, atol=1e-6)


def test_pulled_rows_equal_the_rows_tokens_carried_for_the_same_greedy_reply(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"))
    carried = reply(session, ProbeSettings(attention_layers=(0, 1), top_k=3))
    pulled = reply(session, ProbeSettings(attention_layers=(0, 1), top_k=3, token_rows=False))
    carried_tokens = [e for e in carried if isinstance(e, Token)]
    pulled_tokens = [e for e in pulled if isinstance(e, Token)]
    assert [t.token_id for t in pulled_tokens] == [t.token_id for t in carried_tokens]
    assert all(not t.attention for t in pulled_tokens)
    for token in carried_tokens[1:]:
        rows = host_rows(session.steps, token.index)
        assert rows is not None and set(rows) == set(token.attention)
        for layer, row in token.attention.items():
            np.testing.assert_array_equal(rows[layer], row)
            np.testing.assert_array_equal(
                pulled_tokens[token.index].head_stats[layer], token.head_stats[layer]
            )
    # step 0's rows: the prompt's last row, as the prefill's matrix holds it
    prefill = carried[0]
    step0 = host_rows(session.steps, 0)
    assert step0 is not None
    np.testing.assert_array_equal(step0[0], prefill.attention[0][:, -1])


def test_a_prompt_matrix_crosses_only_for_the_layers_asked_and_its_statistics_for_all(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"))
    every = reply(session, ProbeSettings(attention_layers=(0, 1), top_k=3))[0]
    probes = ProbeSettings(attention_layers=(0, 1), top_k=3, token_rows=False)
    one = reply(session, replace(probes, prompt_layers=(1,)))[0]
    none = reply(session, replace(probes, prompt_layers=()))[0]
    assert set(one.attention) == {1} and not none.attention
    np.testing.assert_array_equal(one.attention[1], every.attention[1])
    for prefill in (one, none):  # the overview's statistics of every watched layer still cross
        assert set(prefill.head_stats) == {0, 1}
        for layer in (0, 1):
            np.testing.assert_array_equal(prefill.head_stats[layer], every.head_stats[layer])
    # Every watched layer's matrix stays in the ring, for a panel that switches to it later.
    kept = host_rows(session.steps, 0, kind=PROMPT)
    assert kept is not None and set(kept) == {0, 1}
    for layer in (0, 1):
        np.testing.assert_array_equal(kept[layer], every.attention[layer])
    reply(session, ProbeSettings(attention_layers=(0, 1), top_k=3))  # rows in the events
    assert host_rows(session.steps, 0, kind=PROMPT) is None  # nothing kept twice


def test_the_trace_keeps_every_step_rows_whatever_the_window_pulls(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"))
    events = reply(session, ProbeSettings.for_chat((0, 1), candidates=True))
    trace = TraceRecorder(session.info)
    for event in events:
        trace.add(event)
    steps = trace.to_dict()["steps"]
    assert len(steps) == 6 and steps[0]["attention"] == {}
    for index, step in enumerate(steps[1:], start=1):
        rows = host_rows(session.steps, index)
        assert rows is not None
        assert set(step["attention"]) == {"0", "1"}  # JSON's keys
        for layer in (0, 1):
            written = np.asarray(step["attention"][str(layer)], dtype=np.float32)
            np.testing.assert_array_equal(written, rows[layer])


def test_the_ring_drops_its_oldest_steps_past_its_cap_and_holds_any_kind():
    ring = StepRing(max_bytes=3 * 400)
    for step in range(6):
        ring.put(step, ATTENTION, {0: torch.full((10, 10), float(step))})  # 400 bytes
    assert ring.steps() == [3, 4, 5] and ring.bytes == 1200
    assert ring.get(2, ATTENTION) is None
    assert float(ring.get(5, ATTENTION)[0][0, 0]) == 5.0
    ring.put(5, "residual", np.zeros(10, dtype=np.float32))  # another per-step payload
    assert ring.steps() == [4, 5]  # the cap counts every kind
    assert ring.get(5, "residual").shape == (10,) and ring.latest == 5
    ring.put(9, ATTENTION, {0: torch.zeros(40, 40)})  # larger than the cap: not kept
    assert ring.get(9, ATTENTION) is None
    ring.start_reply()
    assert ring.steps() == [] and ring.latest is None


@pytest.mark.parametrize("kind", ["llama"])
def test_a_small_ring_ages_steps_out(tokenizer, kind):
    session = ChatSession(make_tiny(tokenizer, kind))
    reply(session, ProbeSettings(attention_layers=(0,), token_rows=False, ring_bytes=2000))
    kept = session.steps.steps()
    assert kept and kept[-1] == 5 and 1 not in kept
    assert host_rows(session.steps, 1) is None


@pytest.mark.skipif(ggml_kernel.ensure() is not None, reason="no GGML kernels here")
@pytest.mark.parametrize("key_dtype", [torch.bfloat16, torch.float32])
def test_the_kernels_causal_rows_are_the_torch_ways(monkeypatch, key_dtype):
    """A decode batch's rows weighed by the C++ op (where the GGML kernels load) and by the
    torch ops: grouped query heads, each query seeing the keys up to its own position, zero
    past it; both against float64."""
    from engine.model import attention_probe

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 9, 6, 64, generator=generator).bfloat16()  # 9 heads, 6 positions
    key = (torch.randn(1, 3, 40, 64, generator=generator) * 2).to(key_dtype)  # 3 key heads
    for rows in (1, 4):
        ours = attention_probe.attention_weights(query, key, None, 0.125, rows)
        q = query[0, :, -rows:].double()
        k = key[0].double().repeat_interleave(3, dim=0)
        scores = (q @ k.transpose(1, 2)) * 0.125
        visible = torch.arange(40)[None, :] <= torch.arange(40 - rows, 40)[:, None]
        exact = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        torch.testing.assert_close(ours.double(), exact, rtol=1e-5, atol=1e-7)
        assert ours.shape == (9, rows, 40) and (ours[:, 0, 40 - rows + 1 :] == 0).all()
        with monkeypatch.context() as patched:
            patched.setattr(
                attention_probe, "ggml_kernel", types.SimpleNamespace(ensure=lambda: "off")
            )
            theirs = attention_probe.attention_weights(query, key, None, 0.125, rows)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
