"""The panels' state model: Qt-free, fed by events, its numbers the engine's own."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from engine.events import Tally
from tests.ui.test_panels import PROMPT, finished, model_info, prefill, token
from ui.panels.state import InternalsState

ROOT = Path(__file__).resolve().parents[2]


def test_importing_and_feeding_the_state_loads_no_qt():
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from engine.events import PrefillDone, Token\n"
        "from ui.panels.state import InternalsState\n"
        "state = InternalsState()\n"
        "state.ingest(PrefillDone(3, 0, 3, 0.0, 0.01, 48, (48,), (1, 2, 3), ('a', 'b', 'c')))\n"
        "state.ingest(Token(0, 7, 'x', 'x', 0.02, 64, (64,)))\n"
        "assert state.cache_tokens == 3 and state.token_text(3) == 'x', state.cache_tokens\n"
        "qt = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "            ('PySide6', 'shiboken6', 'pyqtgraph', 'superqt'))\n"
        "print('loaded:', qt)\n"
        "sys.exit(1 if qt else 0)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loaded: []" in result.stdout


def test_live_rates_are_the_engine_tallys_and_final_ones_finisheds():
    rng = np.random.default_rng(3)
    state = InternalsState()
    state.set_model(model_info())
    first = prefill(rng)
    tokens = [token(rng, i, seconds=s) for i, s in enumerate((0.06, 0.02, 0.03, 0.05))]
    # What the engine's tally holds after the same events.
    tally = Tally(started=0.0, prompt_tokens=PROMPT, tokenize_s=first.tokenize_s)
    tally.prefill_s = first.seconds
    tally.generated = len(tokens)
    tally.ttft_s = first.tokenize_s + tokens[0].seconds
    tally.decode_s = sum(t.seconds for t in tokens[1:])
    state.ingest(first)
    for event in tokens:
        state.ingest(event)
    reply = state.reply
    live = tally.finished("length", "")
    assert reply.decode_tokens_per_s == pytest.approx(live.decode_tokens_per_s, rel=1e-12)
    assert reply.decode_tokens_per_s == pytest.approx(3 / 0.10)
    assert reply.ttft_s == pytest.approx(live.ttft_s)
    assert reply.prefill_tokens_per_s == pytest.approx(first.tokens_per_s)
    # Once Finished arrives its numbers win, even where they differ from the events' sum.
    done = replace(finished(tokens), decode_s=1.5)
    state.ingest(done)
    assert reply.decode_tokens_per_s == done.decode_tokens_per_s == pytest.approx(3 / 1.5)
    assert reply.decode_s == 1.5


def test_clear_keeps_the_model_and_starts_turns_over():
    rng = np.random.default_rng(4)
    state = InternalsState()
    state.set_model(model_info())
    state.set_watched_layers((0, 1))
    state.ingest(prefill(rng))
    state.ingest(token(rng, 0))
    before = dict(state.revisions)
    state.clear()
    assert state.replies == [] and state.attention == {} and state.head_stats == {}
    assert state.cache_tokens == 0 and state.steps == 0 and state.roofline.empty
    assert all(state.revisions[key] > before[key] for key in before)  # every panel redraws
    assert state.info is not None and state.watched_layers == (0, 1)
    state.ingest(prefill(rng))
    assert state.reply.turn == "turn 1"


def test_a_prompts_head_statistics_are_summed_a_chunk_at_a_time_and_stay_exact():
    from ui.panels.state.attention import CHUNK_ROWS, HeadStats

    rng = np.random.default_rng(5)
    heads, queries, keys = 3, 3 * CHUNK_ROWS + 5, 4 * CHUNK_ROWS
    positions = np.arange(keys - queries, keys)
    block = rng.random((heads, queries, keys)).astype(np.float32)
    block *= np.arange(keys) <= positions[:, None]  # causal: no weight past a row's query
    block /= block.sum(axis=2, keepdims=True)
    deferred, row_by_row = HeadStats(heads), HeadStats(heads)
    deferred.add(block, positions)
    for query in range(queries):
        row_by_row.add(block[:, query : query + 1], positions[query : query + 1])
    assert deferred.pending and deferred.rows == 0  # nothing summed inside the event yet
    calls = 0
    while not deferred.settle(deadline=0.0):  # a deadline already past: one chunk a call
        calls += 1
    assert calls == 3 and deferred.rows == queries
    one_more = rng.random((heads, 1, keys)).astype(np.float32)
    deferred.add(block, positions)  # a new block waits; mean() sums it before answering
    deferred.add(one_more, np.array([keys]))
    row_by_row.add(block, positions)
    row_by_row.add(one_more, np.array([keys]))
    for measure in ("max", "entropy"):
        np.testing.assert_allclose(deferred.mean(measure), row_by_row.mean(measure), rtol=1e-6)
    assert not deferred.pending and deferred.rows == row_by_row.rows == 2 * queries + 1


def test_statistics_prepared_before_ingest_equal_those_worked_out_on_ingest():
    """The receiving thread's PreparedStats give every head the same means, row for row, as
    ingest working them out itself: a prompt longer than a chunk, its repeated last row
    (token 0), decode rows, and a second reply's prompt."""
    rng = np.random.default_rng(11)
    first = 8 * PROMPT  # 40 rows: more than one CHUNK_ROWS
    events = [prefill(rng, prompt=first), *(token(rng, i, prompt=first) for i in range(6))]
    second = first + 12
    events += [prefill(rng, prompt=second, reused=first + 4), token(rng, 0, prompt=second)]
    plain, prepared = InternalsState(), InternalsState()
    for state in (plain, prepared):
        state.set_model(model_info())
    prepared.prepared.prepare(events)
    assert len(prepared.prepared) == len(events)  # every event here carries attention
    for event in events:
        plain.ingest(event)
        prepared.ingest(event)
    assert len(prepared.prepared) == 0  # each taken once, when its event was ingested
    assert not prepared.stats_pending  # nothing was left to sum on the GUI thread
    assert plain.stats_pending  # the prompt's rows wait to be summed a chunk at a time
    plain.settle()
    for layer, stats in plain.head_stats.items():
        assert prepared.head_stats[layer].rows == stats.rows == first + 5 + 8
        for measure in ("max", "entropy"):
            np.testing.assert_allclose(
                prepared.head_stats[layer].mean(measure), stats.mean(measure), rtol=1e-9
            )


def test_prepared_statistics_are_only_used_for_their_own_event():
    from ui.panels.state.prepared import PreparedStats

    rng = np.random.default_rng(12)
    prepared = PreparedStats()
    one, other = prefill(rng), prefill(rng)
    prepared.prepare([one, finished([token(rng, 0)])])  # events without attention are not kept
    assert len(prepared) == 1
    assert prepared.take(other) is None
    taken = prepared.take(one)
    assert taken is not None and set(taken) == set(one.attention)
    assert prepared.take(one) is None  # once only


def test_a_tokens_layers_are_summarised_in_one_pass_as_each_on_its_own():
    from ui.panels.state.attention import row_stats
    from ui.panels.state.prepared import PreparedStats

    rng = np.random.default_rng(13)
    event = token(rng, 3, prompt=PROMPT)
    assert len(event.attention) > 1  # every layer's row in one block
    prepared = PreparedStats()
    prepared.prepare([event])
    stats = prepared.take(event)
    assert stats is not None and set(stats) == set(event.attention)
    for layer, row in event.attention.items():
        alone = row_stats(row[:, None, :], np.array([row.shape[1] - 1]))
        np.testing.assert_allclose(stats[layer].max_weight, alone.max_weight, rtol=1e-6)
        np.testing.assert_allclose(stats[layer].entropy, alone.entropy, rtol=1e-6)
        assert stats[layer].rows == 1


def _pulled(event, rng):
    """`event` as the window receives it when it pulls rows: no rows, the engine's per-head
    statistics of them instead ([2, heads] a layer)."""
    stats = {
        layer: np.stack([row.max(axis=1), rng.random(row.shape[0])]).astype(np.float32)
        for layer, row in event.attention.items()
    }
    return replace(event, attention={}, head_stats=stats)


def test_a_batch_of_events_leaves_the_state_as_one_event_at_a_time():
    """ingest_many sums a run of tokens' statistics at once: the same means, rows, cache
    points and candidates as ingest, with a token that carries rows (a teacher's step)
    breaking the run, and a second reply."""
    rng = np.random.default_rng(21)
    events = [prefill(rng)]
    events += [_pulled(token(rng, i), rng) for i in range(5)]
    events += [token(rng, 5)]  # rows, not statistics: summed from them
    events += [_pulled(token(rng, i), rng) for i in range(6, 9)]
    events += [finished(events[1:]), prefill(rng, prompt=PROMPT + 12, reused=PROMPT)]
    events += [_pulled(token(rng, i, prompt=PROMPT + 12), rng) for i in range(4)]
    one, batched = InternalsState(), InternalsState()
    for state in (one, batched):
        state.set_model(model_info())
    for event in events:
        one.ingest(event)
    batched.ingest_many(events[:3])
    batched.ingest_many(events[3:])
    for state in (one, batched):
        state.settle()
    assert set(batched.head_stats) == set(one.head_stats) == {0, 1}
    for layer, stats in one.head_stats.items():
        assert batched.head_stats[layer].rows == stats.rows == PROMPT + 9 + 12 + 4
        for measure in ("max", "entropy"):
            np.testing.assert_allclose(
                batched.head_stats[layer].mean(measure), stats.mean(measure), rtol=1e-12
            )
    np.testing.assert_array_equal(batched.kv_tokens.view(), one.kv_tokens.view())
    np.testing.assert_array_equal(batched.kv_bytes.view(), one.kv_bytes.view())
    assert batched.kv_layers is not None and one.kv_layers is not None
    np.testing.assert_array_equal(batched.kv_layers.view(), one.kv_layers.view())
    assert batched.top_k == one.top_k and batched.chosen == one.chosen
    assert batched.token_texts == one.token_texts and len(batched.replies) == 2
