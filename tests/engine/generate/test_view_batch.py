"""The view's per-token work done in batches (engine/generate/view_batch.py): a batched reply's
Token events equal those of a reply whose tokens each went out at once, the batch's time is in
its tokens' latencies, and a plain reply is never held."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.events import Finished, Token
from engine.generate import view_batch
from engine.generate.session import ChatSession
from engine.model.step_ring import host_rows
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.models import make_tiny

QUESTION = [Message("user", "Why is the sky blue?")]
VIEW = ProbeSettings(attention_layers=(0, 1), top_k=10)
GREEDY = GenerationSettings(greedy=True, max_new_tokens=40, ignore_eos=True)
SAMPLED = GenerationSettings(max_new_tokens=40, ignore_eos=True, seed=3, top_k=20)


@pytest.fixture(scope="module")
def session(tokenizer):
    return ChatSession(make_tiny(tokenizer, "llama"))


def reply(
    session: ChatSession, settings: GenerationSettings, probes: ProbeSettings, monkeypatch, flush_s
) -> tuple[list[Token], Finished, list[int]]:
    """The reply's tokens, its end, and how many tokens each batch finished."""
    monkeypatch.setattr(view_batch, "FLUSH_S", flush_s)
    sizes: list[int] = []
    finish = view_batch.ViewBatch.finish

    def counted(batch, clock):
        tokens = finish(batch, clock)
        sizes.append(len(tokens))
        return tokens

    monkeypatch.setattr(view_batch.ViewBatch, "finish", counted)
    session.reset()
    events = list(session.generate(QUESTION, settings, probes))
    monkeypatch.undo()
    finished = events[-1]
    assert isinstance(finished, Finished)
    return [e for e in events if isinstance(e, Token)], finished, [n for n in sizes if n]


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_batched_tokens_equal_tokens_finished_one_at_a_time(session, settings, monkeypatch):
    one, _, singles = reply(session, settings, VIEW, monkeypatch, flush_s=0.0)
    one_ring = {step: host_rows(session.steps, step) for step in range(40)}
    batched, _, sizes = reply(session, settings, VIEW, monkeypatch, flush_s=60.0)
    assert singles == [1] * 40
    assert sizes == [1, view_batch.MOST_STEPS, 40 - 1 - view_batch.MOST_STEPS]  # token 0 alone
    assert [t.token_id for t in batched] == [t.token_id for t in one]
    assert "".join(t.text for t in batched) == "".join(t.text for t in one)
    for a, b in zip(one, batched, strict=True):
        assert [c.token_id for c in a.top_k] == [c.token_id for c in b.top_k]
        np.testing.assert_allclose([c.prob for c in b.top_k], [c.prob for c in a.top_k], 1e-5)
        assert [c.sampled_prob for c in b.top_k] == pytest.approx(
            [c.sampled_prob for c in a.top_k], rel=1e-5
        )
        assert a.head_stats.keys() == b.head_stats.keys() == ({0, 1} if a.index else set())
        for layer in a.head_stats:
            np.testing.assert_allclose(b.head_stats[layer], a.head_stats[layer], 1e-5, 1e-6)
        assert a.attention.keys() == b.attention.keys()
        for layer in a.attention:
            np.testing.assert_array_equal(b.attention[layer], a.attention[layer])
        assert (a.roofline is None) == (b.roofline is None) == (a.index == 0)
    for step in range(40):  # the ring holds every step's rows, as before
        rows = host_rows(session.steps, step)
        assert rows is not None and one_ring[step] is not None
        assert rows.keys() == one_ring[step].keys() == {0, 1}
        for layer in rows:
            np.testing.assert_array_equal(rows[layer], one_ring[step][layer])


def test_greedy_candidates_are_the_softmax_of_the_logits(session, monkeypatch):
    """The batch's candidates are each step's own: its ten largest logits, their softmax,
    and the greedy choice's probability 1 on the token chosen."""
    logits: list[torch.Tensor] = []
    decode = session.decoder.forward

    def kept(*args, **kwargs):
        out = decode(*args, **kwargs)
        logits.append(out.clone())
        return out

    monkeypatch.setattr(session.decoder, "forward", kept)
    tokens, _, _ = reply(session, GREEDY, VIEW, monkeypatch, flush_s=60.0)
    assert len(logits) == len(tokens)  # the prefill's pass, then one per later token
    for token, step in zip(tokens, logits, strict=True):
        expected = torch.softmax(step.double(), dim=-1).topk(10)
        assert [c.token_id for c in token.top_k] == expected.indices.tolist()
        np.testing.assert_allclose([c.prob for c in token.top_k], expected.values, 1e-5)
        assert [c.sampled_prob for c in token.top_k] == [
            1.0 if c.token_id == token.token_id else 0.0 for c in token.top_k
        ]


def test_the_batchs_time_is_in_its_tokens_latencies(session, monkeypatch):
    tokens, finished, sizes = reply(session, GREEDY, VIEW, monkeypatch, flush_s=60.0)
    assert len(sizes) == 3
    assert finished.decode_s == pytest.approx(sum(t.seconds for t in tokens[1:]), rel=1e-9)
    assert all(t.seconds > 0 for t in tokens)


def test_a_reply_recording_nothing_for_the_view_is_never_held(session, monkeypatch):
    _, _, sizes = reply(session, GREEDY, ProbeSettings.off(), monkeypatch, flush_s=60.0)
    assert sizes == [1] * 40


def test_a_batch_waits_no_longer_than_its_limit(session, monkeypatch):
    """With the real limit, a token waits for its batch at most FLUSH_S (and the next step)."""
    _, _, sizes = reply(session, GREEDY, VIEW, monkeypatch, flush_s=view_batch.FLUSH_S)
    assert sum(sizes) == 40 and sizes[0] == 1
    assert max(sizes) <= view_batch.MOST_STEPS
