"""The view pulls what it draws (docs/view-contract.md), on the shipped client and server over
the in-memory transport: tokens carry per-head statistics, not rows; the latest rows cross for
the watched layers only; a chosen step's rows come from the engine's ring on request, or word
that they aged out."""

from __future__ import annotations

import time

import numpy as np
import pytest

from app.client.delivery import SLOWEST_DRAIN_MS
from app.client.engine_client import EngineClient
from app.server import wire
from app.server.outbox import TOKEN_INTERVAL_S
from app.server.view_rows import ViewRows
from engine.attention_pooling import pool_prompt
from engine.events import Finished, PrefillDone, PromptCells, StepRows, Token
from engine.model.step_ring import PROMPT, StepRing
from engine.settings import GenerationSettings, LoadRequest, ProbeSettings
from tests.app.client.test_worker import HELLO, Recorder
from tests.engines import in_memory
from tests.ui.fakes import FakeBackend

LAYERS = (0, 9, 19, 29)
PULL = ProbeSettings(attention_layers=LAYERS, top_k=5, token_rows=False)
SETTINGS = GenerationSettings(greedy=True, max_new_tokens=40)


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend(pieces=tuple(f" w{i}" for i in range(30)))


@pytest.fixture
def worker(qtbot, backend):
    worker = in_memory(backend.load, backend.make_session)
    with qtbot.waitSignal(worker.loaded, timeout=5000):
        worker.load(LoadRequest(spec="fake-135M"))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    yield worker
    worker.shutdown()


def reply(qtbot, worker: EngineClient, probes: ProbeSettings) -> None:
    with qtbot.waitSignal(worker.busy_changed, timeout=5000, check_params_cb=lambda b: not b):
        assert worker.generate(HELLO, SETTINGS, probes)


def rows_of(events) -> list[StepRows]:
    return [e for e in events if isinstance(e, StepRows)]


def test_without_a_watch_tokens_carry_statistics_and_no_rows_cross(qtbot, backend, worker):
    rec = Recorder(worker)
    reply(qtbot, worker, PULL)
    tokens = [e for e in rec.events if isinstance(e, Token)]
    assert len(tokens) == 30
    assert all(not t.attention for t in tokens)
    assert all(set(t.head_stats) == set(LAYERS) for t in tokens[1:])
    heads = backend.session.info.heads
    assert all(t.head_stats[0].shape == (2, heads) for t in tokens[1:])
    prefill = rec.events[0]
    assert isinstance(prefill, PrefillDone) and not prefill.attention
    assert set(prefill.head_stats) == set(LAYERS)
    assert backend.session.probes.prompt_layers == ()  # the matrix never left the engine's device
    assert rows_of(rec.events) == []


def test_the_latest_rows_cross_only_for_the_watched_layers(qtbot, backend, worker):
    reference = Recorder(worker)
    reply(qtbot, worker, ProbeSettings(attention_layers=LAYERS, top_k=5))  # rows in events
    expected = {e.index: e.attention for e in reference.events if isinstance(e, Token)}

    rec = Recorder(worker)
    worker.watch((9,), 0.0)  # a panel drawing layer 9 at every chance
    reply(qtbot, worker, PULL)
    prefill = [e for e in rec.events if isinstance(e, PrefillDone)][-1]
    assert set(prefill.attention) == {9}  # the prompt's matrix: the watched layer only
    sent = rows_of(rec.events)
    assert sent and all(r.latest and set(r.attention) == {9} for r in sent)
    for rows in sent:  # the rows the engine made at that step
        np.testing.assert_array_equal(rows.attention[9], expected[rows.step][9])
    assert sent[-1].step == 29  # the last step's rows always cross before the end


def test_rows_cross_no_more_often_than_the_panel_draws(qtbot, backend, worker):
    backend.delay = 0.005  # ~200 tokens a second
    rec = Recorder(worker)
    worker.watch(LAYERS, 0.05)
    reply(qtbot, worker, PULL)
    sent = rows_of(rec.events)
    tokens = sum(isinstance(e, Token) for e in rec.events)
    assert 2 <= len(sent) < tokens / 2


def test_a_selected_step_rows_arrive_soon_and_equal_that_step(qtbot, backend, worker):
    reference = Recorder(worker)
    reply(qtbot, worker, ProbeSettings(attention_layers=LAYERS, top_k=5))
    expected = {e.index: e.attention for e in reference.events if isinstance(e, Token)}

    reply(qtbot, worker, PULL)  # the same reply, rows kept in the engine
    rec = Recorder(worker)
    started = time.perf_counter()
    worker.fetch(7)
    qtbot.waitUntil(lambda: bool(rows_of(rec.events)), timeout=2000)
    assert time.perf_counter() - started < 0.1
    (rows,) = rows_of(rec.events)
    assert rows.step == 7 and not rows.latest and not rows.aged_out
    assert set(rows.attention) == set(LAYERS)
    for layer in LAYERS:
        np.testing.assert_array_equal(rows.attention[layer], expected[7][layer])


def test_a_step_that_left_the_ring_says_so(qtbot, backend, worker):
    # At most one step's rows: under 40 keys of context, float32
    row_bytes = backend.session.info.heads * 40 * 4 * len(LAYERS)
    reply(qtbot, worker, ProbeSettings(attention_layers=LAYERS, token_rows=False,
                                       ring_bytes=3 * row_bytes))  # fmt: skip
    rec = Recorder(worker)
    worker.fetch(2)
    worker.fetch(29)
    qtbot.waitUntil(lambda: len(rows_of(rec.events)) == 2, timeout=2000)
    old, latest = rows_of(rec.events)
    assert old.step == 2 and old.aged_out and not old.attention
    assert latest.step == 29 and not latest.aged_out and set(latest.attention) == set(LAYERS)


def test_the_engine_sends_tokens_as_often_as_the_window_takes_them_in(qtbot, worker):
    outbox = worker.engine.server.outbox  # the in-memory engine's server
    assert outbox.interval_s == TOKEN_INTERVAL_S  # as fast as the window's fastest delivery
    worker.set_drain_interval(500)  # panels drawing 2 frames a second: 2 deliveries
    qtbot.waitUntil(lambda: outbox.interval_s == worker.drain_interval / 1000, timeout=5000)
    assert worker.drain_interval == SLOWEST_DRAIN_MS
    worker.set_drain_interval(33)  # a teacher stepping: every frame
    qtbot.waitUntil(lambda: outbox.interval_s == 0.033, timeout=5000)


def test_a_layer_watched_after_the_prompt_gets_its_prompt_matrix_then_its_rows(
    qtbot, backend, worker
):
    """The PrefillDone carries the shown layer's matrix only; switching to another watched
    layer (mid-reply or after it) brings that layer's prompt matrix from the engine's ring,
    as the PrefillDone would have carried it, and then the latest step's rows."""
    reference = Recorder(worker)
    reply(qtbot, worker, ProbeSettings(attention_layers=LAYERS, top_k=5))  # rows in events
    whole = [e for e in reference.events if isinstance(e, PrefillDone)][-1].attention
    expected = {e.index: e.attention for e in reference.events if isinstance(e, Token)}

    worker.watch((9,), 0.0)
    reply(qtbot, worker, PULL)  # the same greedy reply, layer 9 drawn
    rec = Recorder(worker)
    worker.watch((9, 19), 0.0)  # the panel switched to layer 19 once the reply had ended
    qtbot.waitUntil(lambda: len(rows_of(rec.events)) == 2, timeout=2000)
    prompt, latest = rows_of(rec.events)
    assert prompt.prompt and prompt.step == 0 and set(prompt.attention) == {19}
    np.testing.assert_array_equal(prompt.attention[19], whole[19])
    assert latest.latest and latest.step == 29 and set(latest.attention) == {19}
    np.testing.assert_array_equal(latest.attention[19], expected[29][19])
    worker.watch((9, 19), 0.5)  # the same layers: nothing crosses again
    worker.watch((19,), 0.0)
    worker.fetch(3)  # answered after any catch-up the watches above would have sent
    qtbot.waitUntil(lambda: len(rows_of(rec.events)) == 3, timeout=2000)
    assert rows_of(rec.events)[-1].step == 3


def test_a_layer_watched_during_the_prefill_gets_its_matrix_right_after_it():
    """A Watch that arrives while the prompt is processed: the PrefillDone carries the layers
    watched when the reply began, and the ring the rest right behind it."""
    rng = np.random.default_rng(0)
    ring = StepRing(2**20)
    blocks = {layer: rng.random((2, 3, 5)).astype(np.float32) for layer in (0, 9)}
    ring.put(0, PROMPT, blocks)
    rows = ViewRows(lambda reply, weight: None)
    rows.watch(wire.Watch((0, 9)))
    prefill = PrefillDone(
        prompt_tokens=5, reused_tokens=0, processed_tokens=5, tokenize_s=0.0, seconds=0.1,
        kv_bytes=0, kv_bytes_per_layer=(), prompt_token_ids=tuple(range(5)),
        token_texts=("a",) * 5, attention={9: blocks[9]},
    )  # fmt: skip
    first, late = rows.outgoing([prefill], True, ring)
    assert first is prefill
    assert isinstance(late, StepRows) and late.prompt and late.step == 0
    assert set(late.attention) == {0}
    np.testing.assert_array_equal(late.attention[0], blocks[0])
    assert rows.outgoing([prefill], True, None) == [prefill]  # no ring: nothing to add


def test_with_a_grid_the_prompt_crosses_pooled_and_its_rows_before_the_end(qtbot, backend, worker):
    """The watched layer's prompt matrix crosses as cells pooled near the panel's grid, right
    after a PrefillDone without it; its rows follow before the reply's Finished, and again
    when asked."""
    reference = Recorder(worker)
    reply(qtbot, worker, ProbeSettings(attention_layers=LAYERS, top_k=5))  # rows in events
    whole = [e for e in reference.events if isinstance(e, PrefillDone)][-1].attention[9]
    rec = Recorder(worker)
    worker.watch((9,), 0.0, (1, 1))  # a 4-token prompt: 2 x 2 a cell
    reply(qtbot, worker, PULL)
    kinds = [type(e) for e in rec.events]
    start = kinds.index(PrefillDone)
    prefill, cells = rec.events[start : start + 2]
    assert not prefill.attention and set(prefill.head_stats) == set(LAYERS)
    assert isinstance(cells, PromptCells) and set(cells.attention) == {9}
    expected = pool_prompt(whole, (1, 1))
    assert expected is not None and cells.attention[9].nbytes < whole.nbytes
    np.testing.assert_array_equal(cells.attention[9].cells, expected.cells)
    np.testing.assert_array_equal(cells.attention[9].tail, expected.tail)
    prompt = [r for r in rows_of(rec.events) if r.prompt]
    assert len(prompt) == 1 and rec.events.index(prompt[0]) < kinds.index(Finished)
    np.testing.assert_array_equal(prompt[0].attention[9], whole)
    worker.fetch_prompt()
    qtbot.waitUntil(lambda: len([r for r in rows_of(rec.events) if r.prompt]) == 2, timeout=2000)
    again = [r for r in rows_of(rec.events) if r.prompt][-1]
    np.testing.assert_array_equal(again.attention[9], whole)


def test_pooled_prompt_rows_cross_at_a_hold_once_and_on_asking():
    rng = np.random.default_rng(1)
    ring = StepRing(2**22)
    block = rng.random((2, 40, 60)).astype(np.float32)
    ring.put(0, PROMPT, {0: block})
    sent: list = []
    rows = ViewRows(lambda reply, weight: sent.extend(reply.events))
    rows.watch(wire.Watch((0,), 0.0, (4, 4)))
    prefill = PrefillDone(
        prompt_tokens=60, reused_tokens=20, processed_tokens=40, tokenize_s=0.0, seconds=0.1,
        kv_bytes=0, kv_bytes_per_layer=(), prompt_token_ids=tuple(range(60)),
        token_texts=("a",) * 60, attention={0: block},
    )  # fmt: skip
    stripped, cells = rows.outgoing([prefill], True, ring, job=7)
    assert not stripped.attention and isinstance(cells, PromptCells)
    rows.send_owed()  # a hold: the model waits
    rows.send_owed()  # the end: sent already
    assert len(sent) == 1 and sent[0].prompt and sent[0].attention[0] is block
    rows.outgoing([prefill], True, ring, job=8)  # the next reply's, asked for at once
    rows.fetch(8, wire.Fetch(0, prompt=True), StepRing(2**22))  # kept though the ring lost it
    assert len(sent) == 2 and sent[1].prompt and sent[1].attention[0] is block
    rows.fetch(8, wire.Fetch(0, prompt=True), ring)  # again: from the ring
    rows.fetch(8, wire.Fetch(0, prompt=True), StepRing(2**22))  # not in this ring
    assert len(sent) == 4 and sent[2].prompt and not sent[2].aged_out
    np.testing.assert_array_equal(sent[2].attention[0], block)
    assert sent[3].prompt and sent[3].aged_out and not sent[3].attention
    rows.watch(wire.Watch((0,), 0.0, (64, 64)))  # a grid the matrix does not pool for
    assert rows.outgoing([prefill], True, ring) == [prefill]
