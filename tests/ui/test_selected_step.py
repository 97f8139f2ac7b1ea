"""Panels and the selected step: the Attention panel's query row marked on every head, a lone
head's rows, cells and axis tokens selecting their step in every panel, and the Tokens panel
saying what the selected token is."""

from __future__ import annotations

import numpy as np
import pytest
from PySide6.QtCore import QPointF, Qt

from tests.ui.test_panels import HEADS, PROMPT, run_reply
from tests.ui.test_teaching_panels import show
from ui.panels.docks import InternalsView
from ui.panels.state.explain import attention_query, tokens_line


@pytest.fixture
def rng():
    return np.random.default_rng(5)


def click(qtbot, view: InternalsView, point: QPointF) -> None:
    """A click at `point` of the mosaic (its pixels)."""
    qtbot.mouseClick(view.attention.mosaic, Qt.MouseButton.LeftButton, pos=point.toPoint())


def cell_centre(view: InternalsView, row: int, key: int) -> QPointF:
    """Where a lone head's cell is on screen (view units are rows and keys)."""
    return view.attention.mosaic.map_from_view(QPointF(key + 0.5, row + 0.5))


def test_the_selected_steps_query_row_is_outlined_on_every_head(view, rng):
    show(view, "attention")
    run_reply(view, rng, count=4)
    state, panel = view.state, view.attention
    view.redraw(force=True)
    assert panel.marked_row is None  # nothing selected, not stepping: no marker
    state.select(PROMPT + 2)  # step 2, made by the pass that fed token #PROMPT+1
    view.redraw(force=True)
    rows = state.attention[0]
    assert attention_query(state) == PROMPT + 1
    assert panel.marked_row == rows.index_of(PROMPT + 1) is not None
    outlines = panel.mosaic.marker.toSubpathPolygons()
    assert len(outlines) == len(panel.slots) == HEADS  # one per head
    for slot, outline in enumerate(outlines):  # the marked row of each tile
        y, x = panel.layout.origin(slot)
        box = outline.boundingRect()
        key_size, row_size = panel._pixel
        assert (box.left(), box.top()) == (x * key_size, y * row_size + panel.marked_row)
        assert box.height() == 1.0 and box.width() == panel.layout.tile_shape[1] * key_size
    state.select(None)
    view.redraw(force=True)
    assert panel.marked_row is None and panel.mosaic.marker is None


def test_a_lone_heads_cells_and_axis_tokens_select_their_step(qtbot, view, rng):
    show(view, "attention", width=480, height=900)
    run_reply(view, rng, count=4)
    state, panel = view.state, view.attention
    panel.show_head(1)

    def axes_shown() -> bool:
        view.redraw()
        return panel.query_axis.shown and panel.key_axis.shown

    qtbot.waitUntil(axes_shown)
    rows = state.attention[0]
    positions = [int(p) for p in rows.positions]
    # A cell of the row whose query is the last prompt token: the pass that made step 0.
    row = positions.index(PROMPT - 1)
    click(qtbot, view, cell_centre(view, row, 0))
    assert state.selected == PROMPT and state.selected_step == 0
    # The query axis: the token left of a row selects the step that row made.
    row = positions.index(PROMPT + 2)
    y = cell_centre(view, row, 0).y()
    click(qtbot, view, QPointF(panel.mosaic.axis_rect(panel.query_axis).center().x(), y))
    assert state.selected_step == 3
    view.redraw(force=True)
    assert panel.marked_row == row and panel.selected_head == 1  # still the lone head
    assert view.timing.steps_plot.marker == 3.0  # and every other panel follows
    # A prompt row before the last selects its own token; a key's token selects that key.
    click(qtbot, view, cell_centre(view, positions.index(1), 0))
    assert state.selected == 1 and state.selected_step is None
    x = cell_centre(view, 0, 3).x()
    click(qtbot, view, QPointF(x, panel.mosaic.axis_rect(panel.key_axis).center().y()))
    assert state.selected == 3


def test_the_tokens_panel_says_what_the_selected_token_is(view, rng):
    show(view, "tokens")
    _first, tokens = run_reply(view, rng, count=4)
    state, panel = view.state, view.tokens
    view.redraw(force=True)
    assert not panel.step_line.isVisible()  # not stepping, nothing chosen
    state.select(PROMPT + 3)
    view.redraw(force=True)
    expected = f"Step 3 produced token {tokens[3].token_id} 't3' after {PROMPT} prompt tokens"
    assert panel.step_line.text() == tokens_line(state) == expected + ", 0 reused"
    assert panel.step_line.isVisible()
    state.select(2)
    view.redraw(force=True)
    assert panel.step_line.text().startswith("Prompt token #2 is token 2 'p2' processed by")


def test_the_next_token_panel_says_a_selected_steps_sentence_once(view, rng):
    """Stepping or a step chosen: the sentence in the step line, the readout below it hidden;
    otherwise the readout says it."""
    show(view, "next_token")
    run_reply(view, rng, count=4)
    state, panel = view.state, view.next_token
    view.redraw(force=True)
    assert panel.readout.isVisibleTo(panel) and not panel.step_line.isVisibleTo(panel)
    state.select(PROMPT + 2)
    view.redraw(force=True)
    assert panel.step_line.isVisibleTo(panel) and not panel.readout.isVisibleTo(panel)
    assert panel.step_line.text() == panel.summary.text() and panel.summary.text().startswith(
        "Step 2"
    )
