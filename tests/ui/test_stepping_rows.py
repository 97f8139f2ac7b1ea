"""Stepping and choosing tokens with the view pulling its rows (docs/view-contract.md): each Next
token shows that step's attention in the attention panel, and a token chosen after the reply
shows its step's rows, fetched from the engine's ring."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QUrl

from engine.model.step_ring import host_rows
from tests.ui.fakes import FakeBackend
from tests.ui.test_assembled_window import show_attention
from tests.ui.test_stepping import LONG, generated
from ui.panels.state.explain import attention_line, attention_query


@pytest.fixture
def parts(build, qtbot):
    backend = FakeBackend(pieces=LONG)
    parts = build(backend.load, backend.make_session)
    parts.backend = backend
    show_attention(qtbot, parts)
    return parts


def shown_row(parts) -> np.ndarray | None:
    state, layer = parts.internals.state, parts.internals.attention.selected_layer
    query = attention_query(state)
    return None if query is None else state.row_at(layer, query)


def test_next_token_shows_each_steps_attention_in_every_visible_panel(parts, qtbot):
    window, internals = parts.window, parts.internals
    window.settings_panel.set_pause_after_prefill(True)
    assert window.send("Tell me")
    session = parts.backend.session
    qtbot.waitUntil(lambda: session.pacer.pace.waiting, timeout=5000)
    layer = internals.attention.selected_layer
    window.pace.next_action.trigger()  # token 0: its row is the prompt's last
    qtbot.waitUntil(lambda: generated(parts) == 1, timeout=5000)
    for step in (1, 2, 3):
        timing_before = internals.timing.tracker.snapshot()
        window.pace.next_action.trigger()
        qtbot.waitUntil(lambda s=step: generated(parts) == s + 1, timeout=5000)
        # the step's rows crossed before the engine held again
        qtbot.waitUntil(lambda s=step: shown_row(parts) is not None, timeout=5000)
        internals.redraw(force=True)
        expected = host_rows(session.steps, step)
        assert expected is not None
        np.testing.assert_array_equal(shown_row(parts), expected[layer])
        line = internals.attention.step_line.text()
        assert line == attention_line(internals.state, layer, None)
        assert line.startswith(f"Step {step} (query #")
        assert internals.timing.tracker.snapshot() != timing_before
        assert internals.kv_cache.step_line.text().startswith(f"Step {step} ")
        assert internals.next_token.step == step
    window.pace.resume_action.trigger()
    qtbot.waitUntil(lambda: not window.replying, timeout=10000)


def test_a_token_chosen_after_the_reply_shows_its_steps_rows_from_the_engine(parts, qtbot):
    window, internals = parts.window, parts.internals
    assert window.send("Tell me")
    qtbot.waitUntil(lambda: not window.replying, timeout=10000)
    state = internals.state
    layer = internals.attention.selected_layer
    step = next(
        s for s in range(1, len(LONG)) if state.row_at(layer, state.prompt_tokens + s - 1) is None
    )  # a step whose rows did not cross with the latest ones
    internals.tokens.chips.anchorClicked.emit(QUrl(f"token:{state.prompt_tokens + step}"))
    qtbot.waitUntil(lambda: shown_row(parts) is not None, timeout=2000)
    expected = host_rows(parts.backend.session.steps, step)
    assert expected is not None
    np.testing.assert_array_equal(shown_row(parts), expected[layer])
    internals.redraw(force=True)
    assert internals.attention.step_line.text().startswith(f"Step {step} (query #")
