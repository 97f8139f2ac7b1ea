"""The synthetic session keeps the session contract and its numbers add up, as the real one's."""

from __future__ import annotations

import threading
from dataclasses import replace

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


def pushed_and_pulled(tokens: int, layers: tuple[int, ...]) -> tuple[dict, SyntheticSession]:
    """The same reply sent with its rows (by index) and kept in the ring (its session)."""
    pushed = ProbeSettings(attention_layers=layers, top_k=5, token_rows=True)
    sent = {t.index: t for t in reply(SyntheticSession(seed=3), tokens, pushed)[1:-1]}
    session = SyntheticSession(seed=3)
    reply(session, tokens, replace(pushed, token_rows=False))
    return sent, session


def assert_pulled_rows_are_described(sent: dict, session: SyntheticSession, step: int) -> None:
    from app.bench.synthetic_rows import statistics
    from engine.model.step_ring import host_rows

    rows = host_rows(session.steps, step)
    assert rows is not None and set(rows) == set(sent[step].attention)
    for layer, row in rows.items():
        assert row.shape == (BUNDLED_SHAPES.heads, session.count_tokens(MESSAGES) + step)
        assert row.dtype == np.float32
        assert np.array_equal(row, sent[step].attention[layer])
        assert np.allclose(row.sum(axis=1, dtype=np.float64), 1.0, atol=1e-5)
        expected = statistics(row.astype(np.float64)[:, None, :])[:, :, 0]
        assert np.allclose(sent[step].head_stats[layer], expected, rtol=1e-5, atol=1e-6)


def test_rows_kept_on_the_device_are_the_rows_their_statistics_describe():
    """A step's rows stay in the ring unmade (as a GPU engine's stay on its device) until
    pulled; pulled, they are the rows a per-token reply sends, each sums to 1, and the
    statistics worked out from running sums are the rows' own (float64); the ring counts each
    row's bytes as a host copy holds them. Rows under 16 keys are worked out whole."""
    sent, session = pushed_and_pulled(40, (0, 9, 29))
    prompt = session.count_tokens(MESSAGES)
    assert prompt + 1 < 16 < prompt + 11  # steps 1 and 2 short, 11 and on from the sums
    for step in (1, 2, 11, 39):
        assert_pulled_rows_are_described(sent, session, step)
    rows = 3 * BUNDLED_SHAPES.heads * 4 * sum(prompt + i for i in range(1, 40))
    prompt_matrix = 3 * BUNDLED_SHAPES.heads * 4 * (prompt * prompt + prompt)  # and its last row
    assert session.steps.bytes == rows + prompt_matrix


def test_a_long_replys_rows_are_described_across_the_lengthened_noise():
    """Past 2,048 keys the noise is lengthened and its sums made again, mid-reply."""
    sent, session = pushed_and_pulled(2100, (9,))
    for step in (2030, 2039, 2040, 2099):  # from step 2040 (2,048 keys) on: the longer noise
        assert_pulled_rows_are_described(sent, session, step)


def test_a_paced_session_keeps_the_rate_asked_for_when_its_waits_wake_late(monkeypatch):
    """Each wait wakes 0.1 ms late (a timer's slack): at 2,000 tokens a second that cost ~17%
    of the rate when every step waited a whole delay from the last. Now the schedule holds;
    behind it by more than CATCH_UP_S (a stall), the steps due in that span come at once and
    the schedule goes on from there."""
    from app.bench import synthetic

    clock = [100.0]
    session = SyntheticSession(delay=0.0005)

    def wait(seconds: float) -> bool:
        clock[0] += seconds + 0.0001
        return False

    monkeypatch.setattr(synthetic.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(session._cancel, "wait", wait)
    session._next_at = clock[0]
    for _ in range(1000):
        session._wait()
    assert clock[0] - 100.0 == pytest.approx(0.5, abs=2e-4)  # 1,000 steps at 2,000 a second
    clock[0] += 0.05  # a 50 ms stall
    start = clock[0]
    for _ in range(100):
        session._wait()
    caught_up = 99 * 0.0005 - synthetic.CATCH_UP_S  # the 100th step is due this long after
    assert clock[0] - start == pytest.approx(caught_up + 0.0001, abs=2e-4)
