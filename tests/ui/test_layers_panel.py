"""The Layers panel on a real engine: it asks for the step it shows and draws the engine's
logit lens of it, the last layer equal to the Next token panel's candidates."""

from __future__ import annotations

import threading
import time

import pytest

from engine.events import Finished, Token
from engine.settings import GenerationSettings
from tests.ui.test_teaching_panels import show
from ui.panels.state.lens import EMPTY_TEXT, lead_layer, lens_sentence


def send_and_wait(qtbot, parts, text: str, tokens: int = 6) -> list:
    events: list = []
    parts.window.events_received.connect(events.extend)
    parts.window.settings_panel.set_settings(
        GenerationSettings(greedy=True, max_new_tokens=tokens, ignore_eos=True)
    )
    assert parts.window.send(text)
    qtbot.waitUntil(lambda: any(isinstance(e, Finished) for e in events), timeout=30000)
    return events


def shown_step(parts) -> int | None:
    parts.internals.redraw()
    return parts.internals.layers.shown_step


def test_the_panel_shows_the_latest_steps_lens_then_a_selected_one(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    panel, state = parts.internals.layers, parts.internals.state
    show(parts.internals, "layers")
    qtbot.waitUntil(panel.isVisible)
    parts.internals.redraw(force=True)
    assert panel.pages.empty and panel.pages.message.text() == EMPTY_TEXT
    events = send_and_wait(qtbot, parts, "Hello there")
    tokens = [e for e in events if isinstance(e, Token)]
    last = len(tokens) - 1
    qtbot.waitUntil(lambda: shown_step(parts) == last, timeout=10000)
    lens = panel.grid.lens
    assert lens is not None and lens.step == last and lens.token_id == tokens[-1].token_id
    assert lens.layers == parts.window.info.layers and not panel.pages.empty
    # its last layer is the Next token panel's distribution
    final = dict(zip(lens.token_ids[-1], lens.probs[-1], strict=True))
    for candidate in tokens[-1].top_k:
        assert final[candidate.token_id] == pytest.approx(candidate.prob, abs=1e-6)
    assert panel.sentence.text() == f"Step {last}: {lens_sentence(lens)}"
    # a selected step (a token of the reply clicked) shows that step's lens
    state.select(state.prompt_tokens + 2)
    qtbot.waitUntil(lambda: shown_step(parts) == 2, timeout=10000)
    assert panel.grid.lens.step == 2 and panel.grid.lens.token_id == tokens[2].token_id


def test_a_step_made_while_the_panel_was_closed_says_so(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    panel = parts.internals.layers
    parts.internals.docks["layers"].close()
    send_and_wait(qtbot, parts, "Hello there", tokens=3)
    show(parts.internals, "layers")
    qtbot.waitUntil(lambda: "was not kept" in panel.pages.message.text(), timeout=10000)
    assert panel.pages.empty and panel.grid.lens is None
    send_and_wait(qtbot, parts, "And again", tokens=3)  # open now: kept
    qtbot.waitUntil(lambda: shown_step(parts) == 2, timeout=10000)


def test_the_sentence_names_the_layer_where_the_answer_leads():
    from engine.events import LayerLens

    lens = LayerLens(
        step=0, token_id=7, token_text=" sunny",
        token_ids=((5, 7), (5, 7), (7, 5), (7, 5)),
        texts=((" much", " sunny"), (" much", " sunny"), (" sunny", " much"), (" sunny", " much")),
        probs=((0.3, 0.1), (0.4, 0.2), (0.5, 0.1), (0.6, 0.1)),
        chosen_ranks=(1, 1, 0, 0), chosen_probs=(0.1, 0.2, 0.5, 0.6), seconds=0.02,
    )  # fmt: skip
    assert lead_layer(lens) == 2
    assert lens_sentence(lens) == (
        "' sunny' (60% at the end) leads from layer 3 of 4 on; at layer 2 the best guess"
        " was ' much' (40%)."
    )


def test_selecting_a_step_shows_its_lens_quickly(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    panel, state = parts.internals.layers, parts.internals.state
    show(parts.internals, "layers")
    qtbot.waitUntil(panel.isVisible)
    send_and_wait(qtbot, parts, "Hello there", tokens=5)
    qtbot.waitUntil(lambda: shown_step(parts) == 4, timeout=10000)
    started = time.perf_counter()
    state.select(state.prompt_tokens + 1)
    qtbot.waitUntil(lambda: panel.shown_step == 1, timeout=5000)  # the view's own timer
    assert time.perf_counter() - started < 1.0  # a loaded CI machine; docs/lens.md: ~ms


def follow_a_reply(view, monkeypatch, seed: int):
    """The Layers panel on screen, following a reply whose prompt is in, with a long follow
    interval; returns the panel, the steps it asked for, and the reply's random source."""
    import numpy as np

    from tests.ui.test_panels import prefill
    from ui.panels import layers as layers_panel

    rng = np.random.default_rng(seed)
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", 3600.0)
    panel = view.layers
    asked: list[int] = []
    panel.lens_wanted.connect(asked.append)
    show(view, "layers")
    view.ingest(prefill(rng))
    return panel, asked, rng


def test_a_running_reply_asks_for_the_latest_lens_on_an_interval(view, monkeypatch):
    """Each ask is a product through the output head in the engine: while the latest step
    changes, the panel asks at most once an interval; a selected step is asked for at once."""
    from tests.ui.test_panels import PROMPT, token
    from ui.panels import layers as layers_panel

    panel, asked, rng = follow_a_reply(view, monkeypatch, seed=3)
    view.ingest(token(rng, 0))
    view.redraw(force=True)
    assert asked == []  # a new reply: not before it has decoded for an interval
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", view.state.reply.decode_s)
    view.redraw(force=True)
    assert asked == [0]  # it has: at once
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", 3600.0)
    panel.asked(1, 0)
    panel.set_lens(1, None)  # answered (the step not kept): the ask is no longer in flight
    for index in range(1, 6):
        view.ingest(token(rng, index))
        view.redraw(force=True)
    assert asked == [0] and panel.needs_redraw() is False  # five steps waited their turn
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", 0.0)
    assert panel.needs_redraw()
    view.redraw(force=True)
    assert asked == [0, 5]  # the latest step alone, not the ones between
    panel.asked(2, 5)
    panel.set_lens(2, None)
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", 3600.0)
    view.state.select(PROMPT + 2)
    view.redraw(force=True)
    assert asked == [0, 5, 2]  # a selection: at once


def test_the_engine_computes_each_lens_on_its_own_thread_never_the_listener(
    qtbot, build, tiny_loader, monkeypatch
):
    """Asked while a reply runs, while it is held and while the engine is idle, the lens is
    computed by the thread that generates (torch from the listener would start a second pool
    of OpenMP threads, and on two cores that pool halves decoding for good)."""
    parts = build(tiny_loader)
    session = parts.worker.engine.server.session
    threads: list[str] = []
    real = session.layer_lens

    def lens(step, top=10):
        threads.append(threading.current_thread().name)
        return real(step, top)

    monkeypatch.setattr(session, "layer_lens", lens)
    show(parts.internals, "layers")
    qtbot.waitUntil(parts.internals.layers.isVisible)
    send_and_wait(qtbot, parts, "Hello there", tokens=5)  # asked while it runs and at its end
    qtbot.waitUntil(lambda: shown_step(parts) == 4, timeout=10000)
    state = parts.internals.state
    state.select(state.prompt_tokens + 1)  # asked while idle
    qtbot.waitUntil(lambda: parts.internals.layers.shown_step == 1, timeout=10000)
    assert threads and set(threads) == {"glassbox-engine"}  # EngineThread's: the main one


def test_following_a_running_reply_shows_the_newest_lens_received(view, monkeypatch):
    """The answer for the latest step comes after the reply moved on: the panel shows it,
    step named, rather than nothing until the reply ends."""
    import numpy as np

    from engine.events import LayerLens
    from tests.ui.test_panels import prefill, token
    from ui.panels import layers as layers_panel

    rng = np.random.default_rng(4)
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", 3600.0)
    panel = view.layers
    show(view, "layers")
    view.ingest(prefill(rng))
    tokens = [token(rng, index) for index in range(6)]
    view.ingest(tokens[0])
    view.redraw(force=True)
    for later in tokens[1:]:  # the reply goes on while step 0's lens is computed
        view.ingest(later)
    rows = ((tokens[0].token_id, 7),) * 3
    lens = LayerLens(
        0, tokens[0].token_id, "a", rows, (("a", "b"),) * 3, ((0.6, 0.1),) * 3, (0,) * 3,
        (0.6,) * 3, 0.02,
    )  # fmt: skip
    panel.asked(1, 0)
    panel.set_lens(1, lens)
    view.redraw(force=True)
    assert panel.shown_step == 0  # the latest is step 5: step 0's lens, named, meanwhile
    assert panel.sentence.text().startswith("Step 0:")


def test_a_reply_shorter_than_the_interval_has_its_lens_asked_at_its_end(view, monkeypatch):
    """Following a short reply, no ask holds its steps up: its last step's lens is asked for
    once it has ended; a selection is still asked for at once."""
    from tests.ui.test_panels import PROMPT, finished, token

    panel, asked, rng = follow_a_reply(view, monkeypatch, seed=5)
    tokens = [token(rng, index) for index in range(4)]
    for event in tokens:
        view.ingest(event)
        view.redraw(force=True)
    assert asked == []
    view.state.select(PROMPT + 1)
    view.redraw(force=True)
    assert asked == [1]  # a selection: at once, reply running or not
    panel.asked(1, 1)
    panel.set_lens(1, None)
    view.state.select(None)
    view.ingest(finished(tokens))
    view.redraw(force=True)
    assert asked == [1, 3]  # the reply's end: its last step


def a_lens(step: int, token_id: int, seconds: float):
    from engine.events import LayerLens

    rows = ((token_id, 7),) * 3
    return LayerLens(
        step, token_id, "a", rows, (("a", "b"),) * 3, ((0.6, 0.1),) * 3, (0,) * 3, (0.6,) * 3,
        seconds,
    )  # fmt: skip


def test_following_asks_as_often_as_the_lens_cost_allows(view, monkeypatch):
    """Each lens holds the running reply up by its cost: following the latest step, the panel
    asks no more often than keeps that at LENS_SHARE of the model's time, says so, and asks
    for the reply's last step at once when it ends."""
    from tests.ui.test_panels import finished, token
    from ui.panels import layers as layers_panel

    panel, asked, rng = follow_a_reply(view, monkeypatch, seed=6)
    assert panel.follow_interval() == layers_panel.FOLLOW_INTERVAL_S  # no lens yet
    monkeypatch.setattr(layers_panel, "FOLLOW_INTERVAL_S", 0.0)
    tokens = [token(rng, index) for index in range(8)]
    view.ingest(tokens[0])
    view.redraw(force=True)
    assert asked == [0]
    panel.asked(1, 0)
    panel.set_lens(1, a_lens(0, tokens[0].token_id, seconds=0.12))  # a large vocabulary's
    assert panel.follow_interval() == pytest.approx(0.12 / layers_panel.LENS_SHARE)  # 6 s
    view.redraw(force=True)
    assert "a new lens every 6.0 s, as each holds the model up 120 ms" in panel.sentence.text()
    for event in tokens[1:]:
        view.ingest(event)
        view.redraw(force=True)
    assert asked == [0]  # the cost's interval has not passed (FOLLOW_INTERVAL_S is 0 now)
    view.ingest(finished(tokens))
    view.redraw(force=True)
    assert asked == [0, 7]  # the reply's end: its last step at once
    panel.asked(2, 7)
    panel.set_lens(2, a_lens(7, tokens[7].token_id, seconds=0.001))  # a GPU's
    view.redraw(force=True)
    assert panel.shown_step == 7 and "Following" not in panel.sentence.text()  # it ended
    assert panel.follow_interval() == layers_panel.FOLLOW_FLOOR_S  # cheap: the floor
    from app.bench.synthetic import model_info

    view.state.set_model(model_info(name="another model"))
    assert panel.follow_interval() == layers_panel.FOLLOW_INTERVAL_S  # its lens's cost unknown


def test_a_right_to_left_tokens_sentence_keeps_its_quotes_and_probability_in_place():
    """The sentence (and the grid) isolate a Hebrew or Arabic token inside its quotes, as the
    other panels' sentences do (engine.token_labels.quoted)."""
    from engine.events import LayerLens
    from ui.panels.state.sentences import token_text

    lens = LayerLens(
        step=0, token_id=7, token_text="مرحبا", token_ids=((7,), (7,)), texts=(("مرحبا",),) * 2,
        probs=((0.3,), (0.6,)), chosen_ranks=(0, 0), chosen_probs=(0.3, 0.6), seconds=0.01,
    )  # fmt: skip
    assert lens_sentence(lens).startswith("'\u2068مرحبا\u2069' (60%) is the first guess")
    assert token_text(5, "שלום") == "token 5 '\u2068שלום\u2069'"
    assert token_text(5, " the") == "token 5 ' the'"
