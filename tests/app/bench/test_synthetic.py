"""The synthetic session keeps the session contract and its numbers add up, as the real one's."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from app.bench.synthetic import BROKEN, BUNDLED_SHAPES, SyntheticSession, model_info
from engine.events import Finished, PrefillDone, Token
from engine.kv_formula import formula_bytes
from engine.settings import GenerationSettings, Message, ProbeSettings

MESSAGES = [Message("user", "Explain attention in a sentence.")]
PROBES = ProbeSettings(attention_layers=(0, 29), top_k=5)


def reply(session: SyntheticSession, tokens: int, probes: ProbeSettings = PROBES) -> list:
    return list(session.generate(MESSAGES, GenerationSettings(max_new_tokens=tokens), probes))


def test_events_come_in_contract_order_and_finished_is_their_tally():
    session = SyntheticSession(step_s=0.01)
    prefill, *tokens, end = reply(session, 40)
    assert isinstance(prefill, PrefillDone) and isinstance(end, Finished)
    assert all(isinstance(t, Token) for t in tokens)
    assert [t.index for t in tokens] == list(range(40))
    assert end.reason == "length" and end.text == "".join(t.text for t in tokens)
    assert end.generated_tokens == 40 and end.prompt_tokens == prefill.prompt_tokens
    assert end.ttft_s == pytest.approx(prefill.tokenize_s + tokens[0].seconds)
    assert end.decode_s == pytest.approx(sum(t.seconds for t in tokens[1:]))
    assert end.decode_tokens_per_s == pytest.approx(100.0)
    assert session.token_texts == [t.text for t in tokens]


def test_shapes_follow_the_model_info():
    session = SyntheticSession()
    prefill, *tokens, _end = reply(session, 5)
    info = BUNDLED_SHAPES
    assert prefill.kv_bytes == formula_bytes(info, prefill.prompt_tokens)
    assert len(prefill.kv_bytes_per_layer) == info.layers
    assert tokens[-1].kv_bytes == formula_bytes(info, prefill.prompt_tokens + 5)
    matrix = prefill.attention[29]  # [heads, queries, keys], causal, rows sum to 1
    assert matrix.shape == (info.heads, prefill.prompt_tokens, prefill.prompt_tokens)
    assert np.allclose(matrix.sum(axis=2), 1.0) and not np.triu(matrix[0], k=1).any()
    assert tokens[0].attention == {}  # its query is the prefill's last row
    assert tokens[3].attention[0].shape == (info.heads, prefill.prompt_tokens + 3)
    assert len(tokens[3].top_k) == 5 and tokens[3].top_k[0].text == tokens[3].text


def test_given_pieces_end_with_eos_and_a_break_raises_mid_reply():
    session = SyntheticSession(model_info(layers=2), ("Hi", " there"))
    *_, end = reply(session, 10, ProbeSettings.off())
    assert (end.reason, end.text, end.generated_tokens) == ("eos", "Hi there", 2)
    session.raise_after = 1
    with pytest.raises(RuntimeError, match=BROKEN):
        reply(session, 10)
    assert session.calls == [tuple(MESSAGES)] * 2


def test_cancel_from_another_thread_ends_the_reply_within_a_step():
    gate = threading.Semaphore(0)
    session = SyntheticSession(gate=gate)
    events = session.generate(MESSAGES, GenerationSettings(max_new_tokens=100), PROBES)
    next(events)  # the prefill
    gate.release(3)
    tokens = [next(events) for _ in range(3)]
    threading.Timer(0.05, session.cancel).start()
    end = next(events)  # waits for the gate until the cancel
    assert isinstance(end, Finished) and end.reason == "cancelled"
    assert end.text == "".join(t.text for t in tokens)
