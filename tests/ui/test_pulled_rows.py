"""The window's side of the view's pull (docs/view-contract.md): the overview's statistics from
the engine's per-head statistics equal those the window worked out from rows; the latest rows
feed the attention panel; a chosen step's rows are asked for, shown when they come, and a step
that left the engine's ring says so; rows are wanted only for a panel on screen."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from engine.events import StepRows, Token
from engine.generate.head_stats import batch_statistics, prefill_statistics
from tests.ui.test_panels import PROMPT, model_info, prefill, token
from tests.ui.test_visible_redraws import Docked
from ui.panels.docks import shown
from ui.panels.state import InternalsState
from ui.panels.state.explain import attention_line


def pulled(event):
    """`event` as the engine sends it to the window: statistics, no rows."""
    blocks = {layer: torch.from_numpy(np.array(a)) for layer, a in event.attention.items()}
    if isinstance(event, Token):
        stats = batch_statistics([blocks])[0] if event.index else {}
    else:
        stats = prefill_statistics(blocks)
    return replace(event, attention={}, head_stats=stats)


def reply_events(rng, steps: int = 6) -> list:
    return [
        prefill(rng, prompt=8 * PROMPT),
        *(token(rng, i, prompt=8 * PROMPT) for i in range(steps)),
    ]


def test_the_engines_statistics_give_the_overview_the_windows_own_numbers():
    rng = np.random.default_rng(5)
    events = reply_events(rng)
    with_rows, with_stats = InternalsState(), InternalsState()
    for state in (with_rows, with_stats):
        state.set_model(model_info())
    for event in events:
        with_rows.ingest(event)
        with_stats.ingest(pulled(event))
    with_rows.settle()
    assert not with_stats.stats_pending and not with_stats.attention
    for layer, stats in with_rows.head_stats.items():
        assert with_stats.head_stats[layer].rows == stats.rows == 8 * PROMPT + 5
        for measure in ("max", "entropy"):
            np.testing.assert_allclose(
                with_stats.head_stats[layer].mean(measure), stats.mean(measure), rtol=1e-5
            )


def test_the_latest_rows_feed_the_attention_rows_at_their_positions():
    rng = np.random.default_rng(6)
    events = reply_events(rng)
    state = InternalsState()
    state.set_model(model_info())
    for event in events:
        state.ingest(pulled(event))
    last = events[-1]
    state.ingest(StepRows(last.index, dict(last.attention), latest=True))
    rows = state.attention[0]
    assert rows.rows == 1 and int(rows.positions[-1]) == 8 * PROMPT + last.index - 1
    np.testing.assert_array_equal(rows.row_at(8 * PROMPT + last.index - 1), last.attention[0])


def test_a_layers_prompt_matrix_goes_first_in_its_buffer_and_is_taken_once():
    """A prompt matrix that comes after the PrefillDone (the panel switched layers) fills the
    layer's buffer as the PrefillDone would have; a layer whose prompt is in already keeps it."""
    rng = np.random.default_rng(8)
    events = reply_events(rng)
    state = InternalsState()
    state.set_model(model_info())
    first = events[0]
    state.ingest(replace(pulled(first), attention={1: first.attention[1]}))  # layer 1 drawn
    for event in events[1:]:
        state.ingest(pulled(event))
    assert 0 not in state.attention
    state.ingest(StepRows(0, dict(first.attention), prompt=True))
    reference = InternalsState()
    reference.set_model(model_info())
    reference.ingest(replace(pulled(first), attention=dict(first.attention)))
    for layer in (0, 1):
        np.testing.assert_array_equal(
            state.attention[layer].matrix(), reference.attention[layer].matrix()
        )
    last = events[-1]
    state.ingest(StepRows(last.index, dict(last.attention), latest=True))
    state.ingest(StepRows(0, dict(first.attention), prompt=True))  # again: nothing added
    assert state.attention[0].rows == reference.attention[0].rows + 1


def test_a_chosen_step_is_fetched_shown_when_it_comes_or_said_to_have_aged_out():
    rng = np.random.default_rng(7)
    events = reply_events(rng)
    state = InternalsState()
    state.set_model(model_info())
    state.set_watched_layers((0, 1))
    asked: list[int] = []
    state.fetch_rows = asked.append
    for event in events:
        state.ingest(pulled(event))
    prompt = 8 * PROMPT
    state.select(prompt + 3)  # step 3: its query is the token before
    assert asked == [3]
    assert "on its way" in attention_line(state, 0, None)
    state.select(prompt + 3)
    assert asked == [3]  # asked once
    state.ingest(StepRows(3, dict(events[1 + 3].attention)))
    line = attention_line(state, 0, None)
    assert line.startswith("Step 3 (query #") and "on its way" not in line
    np.testing.assert_array_equal(state.row_at(0, prompt + 2), events[4].attention[0])

    state.select(prompt + 1)
    assert asked == [3, 1]
    state.ingest(StepRows(1, {}, aged_out=True))
    assert "left the engine's memory" in attention_line(state, 0, None)


def test_rows_are_wanted_only_while_the_attention_panel_is_on_screen(qtbot):
    """Only the layer the mosaic draws: the other watched layers' rows (and prompt matrices)
    stay in the engine until the panel switches to one."""
    docked = Docked(qtbot)
    view = docked.view
    said: list[tuple] = []
    view.rows_wanted.connect(lambda layers, interval, _grid: said.append((layers, interval)))
    qtbot.waitUntil(lambda: view.rows_wanted_now[0] == ((0,) if shown(view.attention) else ()))
    view.docks["attention"].close()
    qtbot.waitUntil(lambda: bool(said) and said[-1][0] == ())
    view.docks["attention"].show()
    view.docks["attention"].raise_()
    qtbot.waitUntil(lambda: said[-1][0] == (0,))
    assert said[-1][1] == pytest.approx(view.busy_interval / 1000)
    view.attention.select(1)  # the other watched layer
    qtbot.waitUntil(lambda: said[-1][0] == (1,))
    view.set_watched_layers((0,))  # the shown layer no longer watched: none of its rows come
    qtbot.waitUntil(lambda: said[-1][0] == ())
    view.set_watched_layers((0, 1))
    qtbot.waitUntil(lambda: said[-1][0] == (1,))
