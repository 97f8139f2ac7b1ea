"""A prompt's matrix that crossed pooled (docs/view-contract.md, "The prompt's matrix"): the
mosaic drawn from the engine's cells equals the one drawn from the rows, cell for cell; its
rows read as on their way until they come, are asked for once, and fill the placeholders."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from PySide6.QtCore import QPointF
from PySide6.QtWidgets import QApplication, QMainWindow

from engine.attention_pooling import pool_prompt
from engine.events import PooledBlock, PrefillDone, PromptCells, StepRows
from tests.ui.test_mosaic import cell_on_screen, point_at
from tests.ui.test_panels import HEADS, causal, model_info, prefill, token
from tests.ui.test_pulled_rows import pulled
from ui.panels.attention_tiles import describe_cell
from ui.panels.docks import build_docks
from ui.panels.pooled_rows import PooledRows
from ui.panels.state import AttentionRows, InternalsState
from ui.panels.state.explain import attention_line

SHAPES = (
    (100, 1200),
    (256, 1101),
    (200, 2100),
)  # rows the window keeps at those keys  # (prompt rows, keys)
GRIDS = ((61, 242), (32, 32), (200, 500))  # the panel's, as it pools
HINTS = ((61, 242), (16, 64), (128, 512))  # the one the engine pooled at


def pooled(block: np.ndarray, grid: tuple[int, int]) -> PooledBlock:
    """The engine's cells of `block` at `grid` (which must pool it smaller)."""
    cells = pool_prompt(block, grid)
    assert cells is not None
    return cells


def frozen_causal(rng, queries: int, keys: int) -> np.ndarray:
    block = causal(rng, queries, keys).astype(np.float32)
    block.setflags(write=False)
    return block


@pytest.mark.parametrize(("shape", "hint"), list(itertools.product(SHAPES, HINTS)))
def test_a_buffer_started_from_the_engines_cells_pools_to_the_rows_own_image(shape, hint):
    """Pooled at every grid, through decoded rows that join the last run, rewrite nothing and
    drop the oldest half: the same cells as a buffer that holds the prompt's rows; where the
    engine's cells cannot pool to a grid, the panel says so and, once the rows came, pools
    the same cells again."""
    rng = np.random.default_rng(sum(shape) + hint[0])
    queries, keys = shape
    block = frozen_causal(rng, queries, keys)
    cells = pool_prompt(block, hint)
    assert cells is not None and cells.nbytes < block.nbytes / 1.5
    decoded = [causal(rng, 1, keys + i + 1)[:, 0].astype(np.float32) for i in range(170)]
    for grid in GRIDS:
        with_rows, with_cells = AttentionRows(HEADS), AttentionRows(HEADS)
        with_rows.append_block(block)
        assert with_cells.append_pooled(cells) and with_cells.placeholders == cells.rows
        own, from_cells = PooledRows(), PooledRows()
        filled = False
        for step in range(len(decoded) + 1):
            if step:
                with_rows.append_row(decoded[step - 1])
                with_cells.append_row(decoded[step - 1])
            if step % 9 and step != len(decoded):
                own.extend(with_rows)
                from_cells.extend(with_cells)
                continue
            expected = own.update(with_rows, *grid)
            got = from_cells.update(with_cells, *grid)
            if from_cells.missing:
                assert with_cells.fill_prompt(block) or not with_cells.placeholders
                filled = True
                got = from_cells.update(with_cells, *grid)
                assert not from_cells.missing
            assert got[1:] == expected[1:]
            np.testing.assert_array_equal(got[0], expected[0])
        assert with_rows.dropped == with_cells.dropped > 0  # the oldest half went
        if not filled:
            np.testing.assert_array_equal(from_cells.levels(), own.levels())


def test_a_grid_the_cells_cannot_pool_to_is_said_missing():
    rng = np.random.default_rng(3)
    block = frozen_causal(rng, 256, 1101)
    cells = pool_prompt(block, (16, 16))  # coarse: 8 rows and 64 keys a cell
    assert cells is not None and (cells.row_factor, cells.key_factor) == (8, 64)
    rows = AttentionRows(HEADS)
    rows.append_pooled(cells)
    pooled = PooledRows()
    pooled.update(rows, 256, 512)  # finer than the cells
    assert pooled.missing
    rows.fill_prompt(block)
    got = pooled.update(rows, 256, 512)
    reference = PooledRows()
    reference_rows = AttentionRows(HEADS)
    reference_rows.append_block(block)
    expected = reference.update(reference_rows, 256, 512)
    assert got[1:] == expected[1:] == (1, 4)
    np.testing.assert_array_equal(got[0], expected[0])
    assert not pooled.missing


def pooled_reply(seed: int) -> tuple[InternalsState, PrefillDone, dict, list[int]]:
    """A window's state given a 40-token prompt pooled by the engine, both layers, then token
    0: (the state, the PrefillDone with the rows, the cells, the window's asks for the rows)."""
    rng = np.random.default_rng(seed)
    first = prefill(rng, prompt=40)
    state = InternalsState()
    state.set_model(model_info())
    asked: list[int] = []
    state.fetch_prompt = lambda: asked.append(1)
    cells = {layer: pooled(block, (4, 4)) for layer, block in first.attention.items()}
    state.ingest(pulled(first))
    state.ingest(PromptCells(cells))
    state.ingest(pulled(token(rng, 0, prompt=40)))
    return state, first, cells, asked


def test_placeholder_rows_read_as_on_their_way_are_asked_for_once_and_filled():
    state, first, cells, asked = pooled_reply(4)
    rows = state.attention[0]
    assert rows.placeholders == cells[0].rows > 0 and rows.rows == 40
    assert state.row_at(0, 3) is None and asked == [1]
    assert state.row_at(1, 5) is None and asked == [1]  # once a reply
    text = describe_cell(state.token_text, rows, 0, 3, 2)
    assert "on their way" in text
    state.selected = 3
    assert "on its way from the engine" in attention_line(state, 0, None)
    state.ingest(StepRows(0, dict(first.attention), prompt=True))
    assert not state.prompt_rows_awaited
    for layer in (0, 1):
        np.testing.assert_array_equal(state.row_at(layer, 3), first.attention[layer][:, 3, :4])
    assert describe_cell(state.token_text, rows, 0, 3, 2).endswith(
        f"{first.attention[0][0, 3, 2]:.4f}"
    )


def test_rows_that_left_the_engine_leave_the_placeholders_waiting_unasked_again():
    state, _first, _cells, asked = pooled_reply(5)
    assert state.row_at(0, 3) is None and asked == [1]
    state.ingest(StepRows(0, {}, aged_out=True, prompt=True))
    assert not state.prompt_rows_awaited
    state.prompt_rows_asked = False  # even a new ask would not go out
    assert state.row_at(0, 3) is None and asked == [1]
    rows = state.attention[0]
    assert "left the engine's memory" in describe_cell(state.token_text, rows, 0, 3, 2)
    state.selected = 3
    assert "not kept" in attention_line(state, 0, None)


def build_view(qtbot):
    window = QMainWindow()
    qtbot.addWidget(window)
    view = build_docks(window)
    view.timer.stop()
    window.resize(1200, 800)
    window.show()
    qtbot.waitExposed(window)
    view.set_model(model_info())
    view.set_watched_layers((0,))
    QApplication.processEvents()
    return window, view


def test_the_panel_says_its_grid_and_draws_the_engines_cells_as_the_rows(qtbot):
    """The attention panel tells the engine the cells a tile has room for (rows_wanted), and
    a prompt pooled at that grid draws the very mosaic the prompt's rows draw."""
    rng = np.random.default_rng(6)
    prompt = 1000
    first = prefill(rng, prompt=prompt, layers=(0,))
    block = first.attention[0][:, -256:]  # the rows the engine keeps for the window
    (window, with_rows), (other, with_cells) = build_view(qtbot), build_view(qtbot)
    with_rows.ingest(pulled(first))
    with_rows.state.attention.clear()
    with_rows.ingest(StepRows(0, {0: block}, prompt=True))
    with_rows.state.prompt_tokens = prompt
    with_rows.redraw(force=True)
    grid = with_rows.attention.grid
    assert grid is not None and with_rows.rows_wanted_now[2] == grid, grid
    with_cells.ingest(pulled(first))
    with_cells.ingest(PromptCells({0: pooled(block, grid)}))
    with_cells.redraw(force=True)
    assert with_cells.attention.pool_factors == with_rows.attention.pool_factors != (1, 1)
    for head in range(HEADS):
        np.testing.assert_array_equal(
            with_cells.attention.head_tile(head), with_rows.attention.head_tile(head)
        )
    window.close()
    other.close()


def test_before_its_first_rows_the_panel_says_the_grid_a_long_prompt_will_have(qtbot):
    """A first reply's long prompt crosses pooled too: the panel says its grid once it knows
    the model's heads, before any rows, for the flattest tiles a long context draws."""
    window, view = build_view(qtbot)
    view.redraw(force=True)
    qtbot.waitUntil(lambda: view.rows_wanted_now[2] is not None, timeout=5000)
    grid = view.attention.grid
    assert view.rows_wanted_now == ((0,), view.busy_interval / 1000, grid)
    asked: list[int] = []
    view.state.fetch_prompt = lambda: asked.append(1)
    first = prefill(np.random.default_rng(7), prompt=1000, layers=(0,))
    cells = pooled(first.attention[0][:, -256:], grid)
    view.ingest(pulled(first))
    view.ingest(PromptCells({0: cells}))
    view.redraw(force=True)
    row_factor, key_factor = view.attention.pool_factors
    assert row_factor % cells.row_factor == 0 and key_factor % cells.key_factor == 0
    assert not asked  # the cells pool to the grid drawn: no rows asked for
    window.close()


def test_cells_a_buffer_cannot_hold_ask_for_the_rows_at_once():
    """A buffer that keeps fewer rows than the engine pooled (another row budget) takes the
    rows themselves, asked for as the cells come, as they would have crossed."""
    rng = np.random.default_rng(8)
    first = prefill(rng, prompt=300, layers=(0,))
    state = InternalsState(max_attention_rows=64)
    state.set_model(model_info())
    asked: list[int] = []
    state.fetch_prompt = lambda: asked.append(1)
    state.ingest(pulled(first))
    state.ingest(PromptCells({0: pooled(first.attention[0][:, -128:], (8, 8))}))
    assert asked == [1] and not state.attention[0].rows
    state.ingest(StepRows(0, {0: first.attention[0][:, -128:]}, prompt=True))
    rows = state.attention[0]
    assert rows.rows == 64 and not rows.placeholders
    np.testing.assert_array_equal(rows.row_at(299), first.attention[0][:, -1])


def test_a_hovered_prompt_weight_on_its_way_is_written_when_it_comes(qtbot):
    """The pointer rests on a prompt cell whose rows have not come: the line says so and the
    rows are asked for; when they come, the line gives the weight without another move."""
    window, view = build_view(qtbot)
    view.redraw(force=True)  # the panel says the grid a long prompt will have
    asked: list[int] = []
    view.state.fetch_prompt = lambda: asked.append(1)
    first = prefill(np.random.default_rng(9), prompt=1000, layers=(0,))
    block = first.attention[0][:, -256:]
    view.ingest(pulled(first))
    view.ingest(PromptCells({0: pooled(block, view.attention.grid)}))
    view.redraw(force=True)
    panel = view.attention
    at = QPointF(cell_on_screen(panel, 2, 3, 5).toPoint())
    point_at(panel, at)
    assert "on their way" in panel.hover.text() and asked == [1]
    head, row, key = panel.cell_at(panel.mosaic.map_to_view(at))
    query = int(view.state.attention[0].positions[row]) - (1000 - 256)
    view.ingest(StepRows(0, {0: block}, prompt=True))
    view.redraw(force=True)
    assert panel.hover.text().endswith(f": {block[head, query, key]:.4f}")
    window.close()
