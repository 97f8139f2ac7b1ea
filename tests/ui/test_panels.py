"""The internals panels hold exactly what the engine's events say, and stay bounded."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PySide6.QtCore import QObject, QPointF, Qt
from PySide6.QtWidgets import QMainWindow

from app.bench import synthetic
from engine.events import Candidate, Failed, Finished, ModelInfo, PrefillDone, Token, frozen_array
from engine.kv_formula import formula_bytes as kv_formula_bytes
from engine.settings import FEWEST_ROWS
from ui.panels import pooled_rows
from ui.panels import tokens as tokens_panel
from ui.panels.docks import InternalsView, build_docks
from ui.panels.kv_cache import STACKED, formula_text, layer_formula_text
from ui.panels.mosaic import GAP_VALUE, LEVEL_EDGES, MOSAIC_LEVELS
from ui.panels.pooled_rows import DISPLAY_KEYS, DISPLAY_ROWS
from ui.panels.state import AttentionRows, GrowableArray
from ui.panels.state.attention import DROP_BLOCK
from ui.panels.timing import WITH_CACHE, WITHOUT_CACHE, cache_label, format_seconds

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BYTES = 2, 4, 2, 8, 4
PER_TOKEN = 2 * LAYERS * KV_HEADS * HEAD_DIM * BYTES  # 256 bytes for all layers
PROMPT = 5


TINY = dict(
    name="tiny", source="folder", layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS,
    head_dim=HEAD_DIM, parameters=1000, max_context=64, vocab_size=100, bytes_per_value=BYTES,
)  # fmt: skip


def model_info(**changes) -> ModelInfo:
    """A tiny model's shapes, with `changes` applied."""
    return synthetic.model_info(**(TINY | changes))


def causal(rng: np.random.Generator, queries: int, keys: int) -> np.ndarray:
    """[heads, queries, keys] rows summing to 1 over the keys each query may see."""
    weights = rng.random((HEADS, queries, keys)) + 0.01
    positions = np.arange(keys - queries, keys)[:, None]
    weights[:, np.arange(keys)[None, :] > positions] = 0.0
    return weights / weights.sum(axis=2, keepdims=True)


def prefill(rng, prompt=PROMPT, reused=0, layers=(0, 1), seconds=0.05) -> PrefillDone:
    return PrefillDone(
        prompt_tokens=prompt,
        reused_tokens=reused,
        processed_tokens=prompt - reused,
        tokenize_s=0.002,
        seconds=seconds,
        kv_bytes=prompt * PER_TOKEN,
        kv_bytes_per_layer=(prompt * PER_TOKEN // 2,) * 2,
        prompt_token_ids=tuple(range(prompt)),
        token_texts=tuple(f"p{i}" for i in range(prompt)),
        attention={layer: frozen_array(causal(rng, prompt - reused, prompt)) for layer in layers},
    )


def default_seconds(index: int) -> float:
    """Token 0 waits for prefill (0.05 s) and sampling; later steps grow a little."""
    return 0.06 if index == 0 else 0.03 + 0.001 * index


def token(rng, index: int, prompt=PROMPT, layers=(0, 1), seconds=None) -> Token:
    keys = prompt + index
    probs = np.sort(rng.random(3))[::-1]
    probs = probs / probs.sum() * 0.9
    top_k = tuple(
        Candidate(token_id=10 + r, text=f"c{r}", prob=float(p), sampled_prob=float(p) * 0.5)
        for r, p in enumerate(probs)
    )
    return Token(
        index=index,
        token_id=10 + index % 3,
        text=f"t{index}",
        piece=f"t{index}",
        seconds=default_seconds(index) if seconds is None else seconds,
        kv_bytes=keys * PER_TOKEN,
        kv_bytes_per_layer=(keys * PER_TOKEN // 2,) * 2,
        attention={layer: frozen_array(causal(rng, 1, keys)[:, 0, :]) for layer in layers},
        top_k=top_k,
    )


def finished(tokens: list[Token], reused=0) -> Finished:
    decode = sum(t.seconds for t in tokens[1:])
    return Finished(
        reason="length",
        text="".join(t.text for t in tokens),
        prompt_tokens=PROMPT,
        reused_tokens=reused,
        generated_tokens=len(tokens),
        tokenize_s=0.002,
        prefill_s=0.05,
        ttft_s=0.002 + tokens[0].seconds,
        decode_s=decode,
        total_s=0.1 + decode,
    )


def run_reply(view: InternalsView, rng, count=4, reused=0, prompt=PROMPT, finish=True):
    first = prefill(rng, prompt=prompt, reused=reused)
    tokens = [token(rng, i, prompt=prompt) for i in range(count)]
    view.ingest(first)
    for event in tokens:
        view.ingest(event)
    if finish:
        view.ingest(finished(tokens, reused))
    return first, tokens


def expected_matrix(first: PrefillDone, tokens: list[Token], layer: int) -> np.ndarray:
    """The heatmap the events describe: prefill rows, then a row per new query position."""
    keys = PROMPT + len(tokens) - 1
    matrix = np.zeros((HEADS, keys, keys), dtype=np.float32)
    matrix[:, :PROMPT, :PROMPT] = first.attention[layer]
    for t in tokens:
        row = t.attention[layer]
        matrix[:, row.shape[1] - 1, :] = 0.0
        matrix[:, row.shape[1] - 1, : row.shape[1]] = row
    return matrix


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def child_objects(view: InternalsView) -> int:
    """Every Qt object under the panels: a long reply must not add any per token."""
    return sum(len(panel.findChildren(QObject)) for panel in view.panels)


# -- buffers -----------------------------------------------------------------------------------


def test_growable_array_doubles_and_keeps_values():
    array = GrowableArray(np.int64, capacity=4)
    for value in range(1000):
        array.append(value)
    assert array.capacity == 1024
    np.testing.assert_array_equal(array.view(), np.arange(1000))
    rows = GrowableArray(np.float64, width=3, capacity=2)
    for value in range(5):
        rows.append([value, value * 2, value * 3])
    assert rows.view().shape == (5, 3)
    np.testing.assert_array_equal(rows.view()[4], [4, 8, 12])


def test_attention_rows_grow_overwrite_and_drop(rng):
    rows = AttentionRows(HEADS, max_rows=8, capacity=2)
    block = causal(rng, 3, 5)
    assert rows.append_block(block) == 0
    assert (rows.rows, rows.keys) == (3, 5)
    np.testing.assert_array_equal(rows.positions, [2, 3, 4])
    repeat = causal(rng, 1, 5)[:, 0, :]
    assert not rows.append_row(repeat)  # position 4 again replaces the row
    np.testing.assert_allclose(rows.matrix()[:, 2, :], repeat)
    for keys in range(6, 14):
        assert rows.append_row(causal(rng, 1, keys)[:, 0, :])
    assert rows.rows <= 8 and rows.dropped > 0
    assert rows.positions[-1] == 12 and rows.keys == 13
    assert np.all(np.diff(rows.positions) == 1)
    small = AttentionRows(HEADS, max_rows=4)
    block = causal(rng, 6, 6)
    assert small.append_block(block) == 0
    np.testing.assert_array_equal(small.positions, [2, 3, 4, 5])
    np.testing.assert_allclose(small.matrix(), block[:, 2:, :], rtol=1e-6)
    assert small.dropped == 2


def test_attention_rows_keep_rows_times_keys_within_their_cells(rng):
    """As the context grows, fewer rows are kept (never fewer than FEWEST_ROWS): always the
    latest ones, one per position, dropped in whole blocks, and a prompt block is cut to the
    budget at once."""
    cells = 24 * 40
    rows = AttentionRows(HEADS, max_rows=32, max_cells=cells)
    block = causal(rng, 30, 30)
    rows.append_block(block)
    assert rows.rows == 30 and rows.dropped == 0  # 30 x 30 fits
    for keys in range(31, 400):
        dropped = rows.dropped
        rows.append_row(causal(rng, 1, keys)[:, 0, :])
        assert rows.rows <= rows.limit(keys) == max(min(32, cells // keys), FEWEST_ROWS)
        assert rows.positions[-1] == keys - 1 and np.all(np.diff(rows.positions) == 1)
        assert (rows.dropped - dropped) % DROP_BLOCK == 0  # whole blocks of the mosaic's pooling
    assert rows.rows >= FEWEST_ROWS // 2  # dropping halves what is kept, no more
    long = AttentionRows(HEADS, max_rows=32, max_cells=cells)
    block = causal(rng, 32, 60)
    assert long.append_block(block) == 0
    assert long.rows == cells // 60 == 16
    np.testing.assert_allclose(long.matrix(), block[:, -16:, :], rtol=1e-6)


def test_formula_counts_bytes_with_sliding_layers_capped():
    info = model_info(layers=4, sliding_layers=(0, 2), sliding_window=3)
    per_layer_token = 2 * KV_HEADS * HEAD_DIM * BYTES
    # A window of 3: those layers hold the last 2 tokens, as transformers' cache does.
    assert kv_formula_bytes(info, 10) == per_layer_token * (2 * 10 + 2 * 2)
    text = formula_text(info, 10, kv_formula_bytes(info, 10))
    assert f"{per_layer_token * 24:,} bytes" in text
    assert "2 sliding layers" in text and "matches" in text


def test_pooled_rows_match_a_full_max_pool_as_rows_arrive(monkeypatch, rng):
    monkeypatch.setattr(pooled_rows, "DISPLAY_ROWS", 4)
    monkeypatch.setattr(pooled_rows, "DISPLAY_KEYS", 3)
    rows = AttentionRows(HEADS)
    pooled = pooled_rows.PooledRows()
    rows.append_block(causal(rng, 5, 5))
    for keys in range(6, 16):
        rows.append_row(causal(rng, 1, keys)[:, 0, :])
        image, row_factor, key_factor = pooled.update(rows)
        np.testing.assert_array_equal(image, full_max_pool(rows, image, row_factor, key_factor))
        assert image.shape[1] <= 4 and image.shape[2] <= 3
    assert (row_factor, key_factor) == (4, 8)  # 14 rows, 15 keys: powers of two


def full_max_pool(rows: AttentionRows, cells: np.ndarray, row_factor: int, key_factor: int):
    """The reference: every kept row zero-padded (AttentionRows.matrix), max-pooled at once."""
    heads, blocks, columns = cells.shape
    full = np.zeros((heads, blocks * row_factor, columns * key_factor), dtype=np.float32)
    full[:, : rows.rows, : rows.keys] = rows.matrix()
    return full.reshape(heads, blocks, row_factor, columns, key_factor).max(axis=(2, 4))


@pytest.mark.parametrize("grid", [(8, 8), (16, 32), (64, 512), (5, 3)])
def test_a_prompt_blocks_rows_pool_as_their_padded_rows_whatever_lies_past_them(rng, grid):
    """A prompt block's rows are pooled from the block itself: the cells equal a full max-pool
    of the zero-padded rows even where the block holds weights past a row's own position
    (only the causal mask's zeros are there from the engine, but the pooling may not rely on
    it), across pieces, factors, a repeated first row and decode rows after the block."""
    rows = AttentionRows(HEADS, max_rows=200)
    pooled = pooled_rows.PooledRows()
    prompt = causal(rng, 150, 170)
    prompt += np.triu(rng.random((150, 170), dtype=np.float32) + 0.5, k=21)  # past each row
    rows.append_block(prompt)
    for step in range(3):  # the first token's row repeats the prompt's last; then decode rows
        keys = 170 + step
        if step == 0:
            rows.append_block(causal(rng, 2, keys + 1))
        rows.append_row(causal(rng, 1, keys + 2)[:, 0, :])
        cells, row_factor, key_factor = pooled.update(rows, *grid)
        np.testing.assert_array_equal(cells, full_max_pool(rows, cells, row_factor, key_factor))
        fresh = pooled_rows.PooledRows()
        fresh_cells, *factors = fresh.update(rows, *grid)
        assert factors == [row_factor, key_factor]
        np.testing.assert_array_equal(fresh_cells, cells)
    block, query, count = rows.prompt_run(0, rows.rows)  # the last prompt row was rewritten
    assert block is prompt and (query, count) == (0, 149)
    assert rows.prompt_run(149, rows.rows)[1:] == (0, 2)  # by the next block's two rows
    assert rows.prompt_run(151, rows.rows) is None  # a decode row


# -- KV cache ----------------------------------------------------------------------------------


def test_kv_curve_ends_at_the_last_events_bytes(view, rng):
    first, tokens = run_reply(view, rng, count=4)
    view.redraw(force=True)
    x, y = view.kv_cache.curve.getData()
    assert y[-1] == tokens[-1].kv_bytes
    # The empty cache, the prompt's end, then one point per decoded token.
    np.testing.assert_array_equal(x, [0, 5, 6, 7, 8])
    np.testing.assert_array_equal(y, [0, first.kv_bytes] + [t.kv_bytes for t in tokens[1:]])
    # Straight between them: the prompt, written in one pass, is one line from the empty cache
    # (bytes in proportion to tokens), not an empty cache up to its last token and a jump.
    assert not view.kv_cache.curve.step


def test_kv_per_layer_and_stacked_views(view, rng):
    _first, tokens = run_reply(view, rng, count=3)
    view.kv_cache.select_view("layer 1")
    view.redraw(force=True)
    _x, y = view.kv_cache.curve.getData()
    assert y[-1] == tokens[-1].kv_bytes_per_layer[1]
    view.kv_cache.select_view(STACKED)
    view.redraw(force=True)
    top = view.kv_cache.stack_curves[-1]
    assert top.isVisible() and not view.kv_cache.curve.isVisible()
    assert top.getData()[1][-1] == tokens[-1].kv_bytes


def test_one_layers_view_says_that_layers_formula_and_its_own_bytes(view, rng):
    """Showing layer 1 alone, the text is that layer's (what its tensors hold against its
    share of the formula), not the whole cache's."""
    _first, tokens = run_reply(view, rng, count=5)  # 9 tokens cached
    view.kv_cache.select_view("layer 1")
    view.redraw(force=True)
    text = view.kv_cache.formula.text()
    own = tokens[-1].kv_bytes_per_layer[1]
    assert text.startswith(
        f"Layer 1: 2 (K and V) × {KV_HEADS} KV heads × {HEAD_DIM} dims × 9 tokens"
    )
    assert f"= {9 * PER_TOKEN // LAYERS:,} bytes" in text
    assert f"Measured: {own:,} bytes" in text and "matches the formula" in text
    assert f"All {LAYERS} layers: {tokens[-1].kv_bytes:,} bytes" in text
    view.kv_cache.select_view(STACKED)
    view.redraw(force=True)
    assert f"{LAYERS} layers × {KV_HEADS} KV heads" in view.kv_cache.formula.text()


def test_a_sliding_layers_formula_holds_its_window():
    info = model_info(layers=4, sliding_layers=(0, 2), sliding_window=3)
    per_token = 2 * KV_HEADS * HEAD_DIM * BYTES
    sliding = layer_formula_text(info, 0, 10, 2 * per_token, None)
    assert "Layer 0 (sliding: at most the last 2 tokens)" in sliding
    assert f"= {2 * per_token:,} bytes" in sliding and "matches" in sliding
    full = layer_formula_text(info, 1, 10, 2 * per_token, None)
    assert f"= {10 * per_token:,} bytes" in full and "differs from the formula" in full


def test_a_new_chat_keeps_the_kv_layer_curves_a_new_model_makes_them_again(view, rng):
    view.redraw(force=True)
    curves = list(view.kv_cache.stack_curves)
    assert len(curves) == model_info().layers
    view.clear()  # a new chat: new data, same model
    _first, tokens = run_reply(view, rng, count=3)
    view.kv_cache.select_view(STACKED)
    view.redraw(force=True)
    assert view.kv_cache.stack_curves == curves  # the same items, not made again
    assert curves[-1].getData()[1][-1] == tokens[-1].kv_bytes  # drawing the new chat's data
    view.set_model(model_info(layers=3))
    view.redraw(force=True)
    assert len(view.kv_cache.stack_curves) == 3


def test_formula_text_uses_the_models_numbers(view, rng):
    run_reply(view, rng, count=5)  # 5 prompt + 4 decoded tokens = 9 cached
    view.redraw(force=True)
    text = view.kv_cache.formula.text()
    assert f"{9 * PER_TOKEN:,} bytes" in text  # 2,304
    assert "2 layers × 2 KV heads × 8 dims × 9 tokens × 4 bytes" in text
    assert "matches the formula" in text
    assert "(4/2 = 2x)" in text and "grouped-query attention saves 2.2 KiB" in text
    assert view.kv_cache.context.value() == 9 and view.kv_cache.context.maximum() == 64


# -- attention ---------------------------------------------------------------------------------


def head_stack(view: InternalsView) -> np.ndarray:
    """Each shown head's tile of the mosaic, its colour scale undone."""
    panel = view.attention
    return np.stack([panel.head_tile(head) for head in panel.slots])


def test_heatmap_builds_row_by_row_from_the_events(view, rng):
    view.attention.per_head_scale.setChecked(False)  # absolute scale: pixels are the weights
    first = prefill(rng)
    view.ingest(first)
    view.redraw(force=True)
    assert head_stack(view).shape == (HEADS, PROMPT, PROMPT)
    np.testing.assert_array_equal(head_stack(view), first.attention[0])
    tokens = [token(rng, i) for i in range(4)]
    for event in tokens:
        view.ingest(event)
    view.redraw(force=True)
    stack = head_stack(view)
    assert stack.shape == (HEADS, PROMPT + 3, PROMPT + 3)  # token 0 re-reads the last prompt row
    np.testing.assert_array_equal(stack, expected_matrix(first, tokens, 0))
    image = view.attention.mosaic
    assert image.image.dtype == np.float32
    # Weights 0..1 span colours 1..255 of the table; its colour 0 is the gaps' background.
    low, high = image.levels
    assert (low, high) == MOSAIC_LEVELS and image.lut.shape[0] == 256
    index = lambda value: min(max(int((value - low) * 256 / (high - low)), 0), 255)  # noqa: E731
    assert (index(GAP_VALUE), index(0.0), index(1.0)) == (0, 1, 255)
    assert tuple(image.lut[0][:3]) == (0, 0, 0)


def test_layer_choice_hover_text_and_head_focus(view, rng):
    first, tokens = run_reply(view, rng, count=3)
    view.attention.select(1)
    view.redraw(force=True)
    # Each head over its colour level and back: equal to float32 rounding.
    np.testing.assert_allclose(head_stack(view), expected_matrix(first, tokens, 1), rtol=1e-6)
    text = view.attention.describe(head=2, row=6, key=5)
    weight = tokens[2].attention[1][2, 5]
    assert text == f"head 2 · query #6 't1' → key #5 't0': {weight:.4f}"
    assert "causal mask" in view.attention.describe(head=0, row=1, key=3)
    view.attention.select(1, head=2)
    view.redraw(force=True)
    assert view.attention.slots == (2,)
    np.testing.assert_allclose(
        view.attention.head_tile(2), expected_matrix(first, tokens, 1)[2], rtol=1e-6
    )


def test_layer_choices_name_what_is_watched_and_are_not_filled_again_by_a_new_chat(view, rng):
    run_reply(view, rng, count=2)
    view.redraw(force=True)
    choice = view.attention.layer_choice
    watched = set(view.state.watched_layers) | {0, 1}  # the reply recorded layers 0 and 1
    later = " (watch from the next reply)"
    names = [choice.itemText(i) for i in range(choice.count())]
    assert names == [f"layer {n}" + ("" if n in watched else later) for n in range(LAYERS)]
    filled: list[object] = []
    choice.model().rowsInserted.connect(lambda *_: filled.append(1))
    view.attention.select(1)
    view.clear()  # a new chat: nothing recorded until its first reply
    view.redraw(force=True)
    run_reply(view, rng, count=2)
    view.redraw(force=True)
    assert not filled and choice.currentData() == 1


def test_per_head_scale_uses_a_high_quantile_of_each_head(view, rng):
    first, tokens = run_reply(view, rng, count=2)
    panel = view.attention
    assert panel.per_head_scale.isChecked()  # the default
    view.redraw(force=True)
    expected = expected_matrix(first, tokens, 0)
    assert tuple(panel.mosaic.levels) == MOSAIC_LEVELS  # 1.0: the top colour
    one_bin = LEVEL_EDGES[-1] / LEVEL_EDGES[-2]  # the levels are read from log-spaced bins
    for slot, head in enumerate(panel.slots):
        weights = np.sort(expected[head][expected[head] > 0])
        level = 1.0 / panel.tile_scale[slot]
        # np.quantile interpolates between two neighbouring weights; the level lies between
        # them too, give or take one bin.
        rank = 0.99 * (weights.size - 1)
        below, above = weights[math.floor(rank)], weights[math.ceil(rank)]
        assert below / one_bin <= level <= above * one_bin
        assert level < 1.0  # not pinned by the first query's weight of 1
        # The tile's pixels are the head's weights over its level: 1.0 is the top colour.
        tile = panel.layout.tile(panel.mosaic.image, slot)
        np.testing.assert_allclose(tile, expected[head] / level, rtol=1e-6)


def test_overview_shows_mean_max_weight_and_click_selects(qtbot, view, rng):
    first, tokens = run_reply(view, rng, count=3)
    view.redraw(force=True)
    overview = view.attention.overview_image.image
    assert overview.shape == (LAYERS, HEADS)
    rows = [first.attention[1][:, q, :].max(axis=1) for q in range(PROMPT)]
    rows += [t.attention[1].max(axis=1) for t in tokens[1:]]  # token 0 repeats the last row
    np.testing.assert_allclose(overview[1], np.mean(rows, axis=0), rtol=1e-5)
    view.attention.measure_choice.setCurrentIndex(1)
    view.redraw(force=True)
    entropy = view.attention.overview_image.image
    assert np.all((entropy >= 0) & (entropy <= 1 + 1e-6))
    # Clicking cell (layer 1, head 3) selects it.
    grid = view.attention.overview
    grid.resize(300, 300)
    area = grid.plot_rect()
    point = QPointF(
        area.left() + 3.5 / HEADS * area.width(), area.top() + 1.5 / LAYERS * area.height()
    )
    assert view.attention.overview_cell(point) == (1, 3)
    assert view.attention.overview_cell(QPointF(area.left() - 2, point.y())) is None  # a label
    qtbot.mouseClick(grid, Qt.MouseButton.LeftButton, pos=point.toPoint())
    assert (view.attention.selected_layer, view.attention.selected_head) == (1, 3)


def test_the_overview_paints_its_lowest_and_highest_means_at_the_colour_tables_ends(view, rng):
    run_reply(view, rng, count=3)
    view.redraw(force=True)
    grid = view.attention.overview
    picture = grid.grab().toImage()  # at the size its panel's layout gives it
    image, area = grid.image, grid.plot_rect()
    lut = view.attention._lut
    rows, columns = image.shape
    for flat, end in ((int(image.argmin()), lut[0]), (int(image.argmax()), lut[-1])):
        row, column = divmod(flat, columns)
        x = area.left() + (column + 0.5) / columns * area.width()
        y = area.top() + (row + 0.5) / rows * area.height()
        colour = picture.pixelColor(round(x), round(y))
        assert (colour.red(), colour.green(), colour.blue()) == tuple(int(c) for c in end[:3])


def test_picking_an_unwatched_layer_requests_it(qtbot, rng):
    internals = InternalsView()
    qtbot.addWidget(internals.attention)
    internals.set_model(model_info(layers=4))
    internals.set_watched_layers((0,))
    internals.redraw(force=True)
    with qtbot.waitSignal(internals.watched_layers_requested) as blocker:
        internals.attention.select(2)
    assert blocker.args == [(0, 2)]
    internals.redraw(force=True)
    assert "not watched" in internals.attention.hover.text()
    internals.timer.stop()


# -- timing ------------------------------------------------------------------------------------


def test_step_curve_has_one_point_per_decode_step(view, rng):
    first = prefill(rng)
    tokens = [token(rng, i) for i in range(6)]
    view.ingest(first)
    for event in tokens:
        view.ingest(event)
    view.redraw(force=True)
    x, y = view.timing.step_curve.getData()
    np.testing.assert_array_equal(x, [1, 2, 3, 4, 5])
    np.testing.assert_array_equal(y, [t.seconds for t in tokens[1:]])
    live = 5 / sum(t.seconds for t in tokens[1:])
    assert f"{live:.1f} tok/s (live" in view.timing.numbers.text()
    ttft = first.tokenize_s + tokens[0].seconds
    assert f"{ttft * 1000:.0f} ms" in view.timing.numbers.text()
    done = finished(tokens)
    view.ingest(done)
    view.redraw(force=True)
    assert f"{done.decode_tokens_per_s:.1f} tok/s (final" in view.timing.numbers.text()
    widths = {name: bar.opts["width"][0] for name, bar in view.timing.phase_bars.items()}
    assert widths["prefill"] == pytest.approx(first.seconds)
    assert widths["first token"] == pytest.approx(tokens[0].seconds - first.seconds)
    assert widths["decode"] == pytest.approx(done.decode_s)


def test_hovering_a_timeline_bar_names_its_phase_and_duration(view, rng):
    run_reply(view, rng, count=4)
    run_reply(view, rng, count=6)
    view.redraw(force=True)
    chart = view.timing.timeline
    chart.resize(500, 200)
    area = chart.plot_rect()
    reply = view.state.replies[1]
    start = reply.tokenize_s + reply.prefill_s + reply.first_token_extra_s
    top, height = chart.row_band(1, area)
    middle = chart.x_at(start + reply.finished.decode_s / 2, area)
    said = chart.describe_at(QPointF(middle, top + height / 2))
    assert said == f"turn 2: decode {format_seconds(reply.finished.decode_s)}"
    assert chart.describe_at(QPointF(middle, area.bottom() - 1)) == ""  # under the last row


def test_while_a_reply_decodes_only_its_decode_bar_is_set_again(view, rng, monkeypatch):
    from ui.panels import redraw

    clock = {"now": 100.0}
    monkeypatch.setattr(redraw.time, "monotonic", lambda: clock["now"])  # the throttle's clock
    view.ingest(prefill(rng))
    tokens = [token(rng, 0)]
    view.ingest(tokens[0])
    view.redraw(force=True)
    bars = view.timing.phase_bars
    before = {name: bar.opts["width"] for name, bar in bars.items()}
    tokens.append(token(rng, 1))
    view.ingest(tokens[1])
    view.redraw(force=True)  # within the second: the step curve follows, the timeline waits
    assert all(bar.opts["width"] is before[name] for name, bar in bars.items())
    assert len(view.timing.step_curve.getData()[0]) == 1
    assert view.timing.needs_redraw() is False
    clock["now"] += 1.0  # a second on, the timeline is due even with no new token
    assert view.timing.needs_redraw()
    view.redraw(force=True)
    kept = {name for name, bar in bars.items() if bar.opts["width"] is before[name]}
    assert kept == {"tokenize", "prefill", "first token"}
    assert bars["decode"].opts["width"][-1] == pytest.approx(view.state.reply.decode_s)
    done = finished(tokens)
    view.ingest(done)  # the reply's end shows at once
    view.redraw(force=True)
    assert bars["decode"].opts["width"][-1] == pytest.approx(done.decode_s)


def test_turn_bars_split_reused_and_prefilled_tokens(view, rng):
    first = prefill(rng)
    tokens = [token(rng, i) for i in range(3)]
    view.ingest_many([first, *tokens, finished(tokens)])  # a batch, as the window sends them
    run_reply(view, rng, count=3, reused=3)
    view.redraw(force=True)
    np.testing.assert_array_equal(view.timing.reused_bars.opts["height"], [0, 3])
    np.testing.assert_array_equal(view.timing.processed_bars.opts["height"], [5, 2])
    np.testing.assert_array_equal(view.timing.processed_bars.opts["y0"], [0, 3])
    _x, ttft = view.timing.ttft_curve.getData()
    assert len(ttft) == 2 and np.all(ttft > 0)
    x, y = view.kv_cache.curve.getData()
    assert (x[0], x[1]) == (3, 5) and y[0] == 3 * PER_TOKEN  # cache kept 3 tokens, then a jump


def test_the_turns_chart_draws_its_axes_again_only_when_they_change(view, rng):
    """Each turn's TTFT is a point of the chart; its axes, labels and title are kept as
    pixels while the turns and ranges stay, and drawn again when a turn is added."""
    chart = view.timing.turns_plot
    chart.resize(500, 300)
    for _turn in range(3):
        run_reply(view, rng, count=2)
    view.redraw(force=True)
    turns, ttft = view.timing.ttft_curve.getData()
    np.testing.assert_array_equal(turns, [0, 1, 2])
    np.testing.assert_array_equal(ttft, [reply.ttft_s for reply in view.state.replies])
    chart.grab()
    drawn = chart.frames_drawn
    chart.grab()
    view.redraw(force=True)
    chart.grab()
    assert chart.frames_drawn == drawn  # nothing changed: the kept pixels
    run_reply(view, rng, count=2)
    view.redraw(force=True)
    chart.grab()
    assert chart.frames_drawn == drawn + 1  # a fourth turn: its label, and the columns move
    assert "turn 4" in chart.describe_turn(3) and "prefilled" in chart.describe_turn(3)


def test_compare_overlays_the_previous_reply_with_labels(view, rng):
    view.set_next_reply_label(cache_label(False))
    _first, slow = run_reply(view, rng, count=4)
    view.set_next_reply_label(cache_label(True))
    _first, fast = run_reply(view, rng, count=4)
    view.compare_with_previous(True)
    view.redraw(force=True)
    timing = view.timing
    assert timing.previous_curve.isVisible()
    np.testing.assert_array_equal(timing.previous_curve.getData()[1], [t.seconds for t in slow[1:]])
    np.testing.assert_array_equal(timing.step_curve.getData()[1], [t.seconds for t in fast[1:]])
    assert timing.steps_plot.legend_names() == [WITH_CACHE, WITHOUT_CACHE]
    assert [reply.turn for reply in view.state.replies] == ["turn 1", "turn 2"]
    view.compare_with_previous(False)
    view.redraw(force=True)
    assert not timing.previous_curve.isVisible()
    assert timing.steps_plot.legend_names() == [WITH_CACHE]


def test_failure_is_reported(view, rng):
    view.ingest(prefill(rng))
    view.ingest(Failed(message="out of memory", error_type="RuntimeError"))
    view.redraw(force=True)
    assert "failed: out of memory" in view.timing.numbers.text()
    assert view.state.reply.error == "out of memory"


def test_failure_before_prefill_leaves_the_last_reply_alone(view, rng):
    run_reply(view, rng, count=3)
    done = view.state.reply.finished
    view.ingest(Failed(message="prompt <too> long", error_type="ContextFull"))
    view.ingest(
        Finished(
            reason="error",
            text="",
            prompt_tokens=0,
            reused_tokens=0,
            generated_tokens=0,
            tokenize_s=0.0,
            prefill_s=0.0,
            ttft_s=0.0,
            decode_s=0.0,
            total_s=0.0,
        )
    )
    view.redraw(force=True)
    assert len(view.state.replies) == 1 and view.state.reply.finished is done
    assert view.state.reply.error is None
    assert "failed: prompt &lt;too&gt; long" in view.timing.numbers.text()


# -- next token --------------------------------------------------------------------------------


def test_top_k_bars_follow_the_latest_step_and_browse(view, rng):
    _first, tokens = run_reply(view, rng, count=4)
    view.redraw(force=True)
    panel = view.next_token
    assert panel.step == 3
    last = tokens[3]
    rows = panel.chart.rows
    np.testing.assert_allclose([r.prob for r in rows], [c.prob for c in last.top_k])
    np.testing.assert_allclose([r.sampled_prob for r in rows], [c.sampled_prob for c in last.top_k])
    view.next_token.show_step(1)
    view.redraw(force=True)
    chosen = [c.token_id == tokens[1].token_id for c in tokens[1].top_k]
    assert panel.step == 1 and not panel.follow.isChecked()
    rows = panel.chart.rows
    np.testing.assert_allclose([r.prob for r in rows], [c.prob for c in tokens[1].top_k])
    assert [r.chosen for r in rows] == chosen
    assert "t1" in panel.summary.text()
    panel.spin.setValue(2)
    view.redraw(force=True)
    assert panel.step == 2


def test_clicking_a_token_of_the_reply_shows_its_step(view, rng):
    from PySide6.QtCore import QUrl

    _first, tokens = run_reply(view, rng, count=4)
    view.redraw(force=True)
    panel = view.next_token
    strip = panel.tokens.toPlainText().replace("\u200b", "")
    assert strip == "".join(view.state.token_text(PROMPT + i) for i in range(4))
    # Each token is a link to its own step.
    block, links = panel.tokens.document().begin(), []
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            text = fragment.text().replace("\u200b", "")
            links += [(fragment.charFormat().anchorHref(), text)] if text else []
            it += 1
        block = block.next()
    assert links == [(f"step:{i}", view.state.token_text(PROMPT + i)) for i in range(4)]
    panel.tokens.anchorClicked.emit(QUrl("step:2"))  # what a click on the third token sends
    view.redraw(force=True)
    assert panel.step == 2 and not panel.follow.isChecked()
    np.testing.assert_allclose(
        [r.prob for r in panel.chart.rows], [c.prob for c in tokens[2].top_k]
    )
    view.ingest(prefill(rng))  # a new reply starts the strip over
    view.redraw(force=True)
    assert panel.tokens.toPlainText() == ""


def test_the_token_strip_keeps_the_spaces_between_tokens_across_frames(view, rng):
    """Each frame appends HTML; a fragment's leading space must not be collapsed away."""
    from dataclasses import replace

    view.ingest(prefill(rng))
    pieces = [" The", " sea", ",", " a", " mirror"]
    for index, piece in enumerate(pieces):
        view.ingest(replace(token(rng, index), piece=piece, text=piece))
        view.redraw(force=True)  # one frame per token: every piece starts a new fragment
    shown = view.next_token.tokens.toPlainText().replace("\u200b", "")
    assert shown == "".join(pieces)


def test_a_turns_ttft_shows_over_its_prompt_bar(view, rng):
    """A TTFT point that falls inside its turn's bar is drawn over it, not hidden behind."""

    view.docks["timing"].setFloating(True)
    view.docks["timing"].resize(700, 700)
    view.docks["timing"].show()
    for turn, (prompt, reused) in enumerate([(5, 0), (40, 3)]):
        first = prefill(rng, prompt=prompt, reused=reused)
        tokens = [
            token(rng, i, prompt=prompt, seconds=0.02 if turn and i == 0 else None)
            for i in range(3)
        ]
        for event in (first, *tokens, finished(tokens, reused)):
            view.ingest(event)
    panel = view.timing
    panel.redraw()
    ttft = view.state.replies[1].ttft_s
    bar_top = view.state.replies[1].reused_tokens + view.state.replies[1].processed_tokens
    chart = panel.turns_plot
    point = chart.point_at(1.0, ttft)
    assert point.y() > chart.y_at(bar_top, chart.plot_rect())  # inside the bar
    image = chart.grab().toImage()
    colour = image.pixelColor(round(point.x()), round(point.y()))
    assert colour.red() > 150 and colour.blue() < 120, colour.name()  # the red point, not blue


def _chips(panel) -> tuple[str, list[tuple[object, ...]]]:
    """The Tokens panel's text and each chip's start, colour, tooltip, link and weight."""
    chips = []
    for position, start in enumerate(panel._starts):
        chip = panel.chip_format(position)
        chips.append((start, chip.background().color().name(), chip.toolTip(),
                      chip.anchorHref(), chip.fontWeight()))  # fmt: skip
    return panel.chips.toPlainText(), chips


@pytest.mark.parametrize("shared", ["all", "new chat", "some", "none"])
def test_a_new_replys_token_chips_equal_a_strip_drawn_from_scratch(rng, view, shared):
    """A new reply keeps the chips its prompt shares with the last strip (re-coloured where a
    reply token became a reused prompt token) and drops the rest: the strip reads exactly as
    one drawn for that reply alone."""
    from dataclasses import replace

    fresh = InternalsView()
    fresh.timer.stop()  # frames are drawn here
    fresh.set_model(model_info())
    kept = view
    views = [kept, fresh]
    run_reply(kept, rng, count=3)  # prompt p0..p4, then the reply's t0..t2
    kept.tokens.redraw()
    trail = kept.state.trail
    if shared == "new chat":  # its panels say what they will show, then the same prompt
        kept.clear()
        kept.tokens.redraw()
        assert kept.tokens.pages.empty
    if shared in ("all", "new chat"):  # the same prompt again (a regenerated reply)
        ids, labels, reused = trail.ids[:PROMPT], trail.labels[:PROMPT], 0
    elif shared == "some":  # the next turn: the last prompt and reply reused, two more tokens
        ids = [*trail.ids, 90, 91]
        labels, reused = [*trail.labels, "u0", "u1"], len(trail.ids)
    else:
        ids, labels, reused = [70, 71, 72], ["a", "b", "c"], 0
    second = replace(
        prefill(rng, prompt=len(ids), reused=reused),
        prompt_token_ids=tuple(ids), token_texts=tuple(labels),
    )  # fmt: skip
    tokens = [token(rng, i, prompt=len(ids)) for i in range(2)]
    for internals in views:
        for event in (second, tokens[0]):
            internals.ingest(event)
        internals.tokens.redraw()
        internals.ingest(tokens[1])
        internals.tokens.redraw()
    assert kept.tokens.shown == fresh.tokens.shown == len(ids) + 2
    assert _chips(kept.tokens) == _chips(fresh.tokens)
    kept.state.select(1)  # selecting still re-colours its chip alone
    kept.tokens.redraw()
    assert kept.tokens.chip_format(1).background().color() == tokens_panel.SELECTED
    for dock in fresh.docks.values():
        dock.close()
        dock.deleteLater()


@pytest.mark.parametrize("seed", range(20))
def test_the_chips_whose_kind_changed_are_the_ones_a_look_at_every_chip_finds(seed):
    """Only the ranges between the two trails' prompt ends and reused ends are looked at; the
    positions found equal a comparison of every shared chip, special tokens included."""
    from ui.panels.state.tokens import TokenTrail

    rng = np.random.default_rng(seed)
    ids = [int(i) for i in rng.integers(0, 6, 40)]
    trails = []
    for _ in range(2):
        prompt = int(rng.integers(0, 41))
        reused = int(rng.integers(0, prompt + 1))
        special = frozenset({0, 1}) if seed % 3 else frozenset({int(rng.integers(0, 6))})
        trails.append(TokenTrail(ids, [str(i) for i in ids], special, prompt, reused))
    old, new = trails
    kept = int(rng.integers(0, 41))
    every = [p for p in range(kept) if tokens_panel._kind(old, p) != tokens_panel._kind(new, p)]
    assert tokens_panel._kind_changes(old, new, kept) == every


def test_a_long_prompts_chips_come_a_slice_at_a_time_and_all_arrive(qtbot, rng):
    """One redraw adds at most CHIPS_PER_REDRAW chips and leaves the rest to the frame's next
    slices (the frame draws the panel again until it is done); a chip selected before it
    arrived comes in selected and is scrolled to; a forced redraw adds every chip at once."""
    prompt = 3 * tokens_panel.CHIPS_PER_REDRAW + 17
    views = [InternalsView(), InternalsView()]
    for view in views:
        for dock in view.docks.values():
            qtbot.addWidget(dock)
        view.set_model(model_info())
        view.ingest(prefill(rng, prompt=prompt, layers=(0,)))
        view.state.select(prompt - 5)
    sliced, forced = views
    forced.timer.stop()
    forced.redraw(force=True)
    assert forced.tokens.shown == prompt and not forced.tokens.unfinished
    panel = sliced.tokens
    sliced.timer.stop()  # no ticks: the frame a shown dock starts finishes the chips alone
    panel.redraw()
    assert tokens_panel.CHIPS_BETWEEN_CLOCKS <= panel.shown <= tokens_panel.CHIPS_PER_REDRAW
    assert panel.unfinished and panel.needs_redraw()
    sliced.docks["tokens"].show()
    qtbot.waitUntil(lambda: panel.shown == prompt, timeout=10_000)
    assert not panel.unfinished
    for view in views:
        chip = view.tokens.chip_format(prompt - 5)
        assert chip.background().color() == tokens_panel.SELECTED
        # and the strip went to it, as to a chip selected once it was there
        assert view.tokens.chips.textCursor().position() == view.tokens._starts[prompt - 5]
    assert _chips(panel) == _chips(forced.tokens)


def test_a_redraw_adds_chips_for_its_time_slice_only(qtbot, rng, monkeypatch):
    """Past CHIPS_SLICE_S a redraw stops adding chips at the next look at the clock: with no
    time at all, one look's worth (CHIPS_BETWEEN_CLOCKS) a redraw, and every chip in the end."""
    monkeypatch.setattr(tokens_panel, "CHIPS_SLICE_S", 0.0)
    view = InternalsView()
    for dock in view.docks.values():
        qtbot.addWidget(dock)
    view.timer.stop()
    prompt = 5 * tokens_panel.CHIPS_BETWEEN_CLOCKS + 3
    view.set_model(model_info())
    view.ingest(prefill(rng, prompt=prompt, layers=(0,)))
    panel = view.tokens
    redraws = 0
    while panel.needs_redraw():
        panel.redraw()
        redraws += 1
        assert panel.shown == min(redraws * tokens_panel.CHIPS_BETWEEN_CLOCKS, prompt)
    assert redraws == 6 and not panel.unfinished


# -- the view ----------------------------------------------------------------------------------


def test_thousands_of_tokens_add_no_items_and_stay_bounded(qtbot, rng):
    internals = InternalsView(max_attention_rows=64)
    for dock in internals.docks.values():
        qtbot.addWidget(dock)
    internals.set_model(model_info())
    internals.set_watched_layers((0,))
    internals.ingest(prefill(rng, layers=(0,)))
    internals.ingest(token(rng, 0, layers=(0,)))
    internals.redraw(force=True)
    before = child_objects(internals)
    row = np.full((HEADS, 1), 1.0)
    for index in range(1, 5000):
        keys = PROMPT + index
        attention = {0: frozen_array(np.pad(row, ((0, 0), (keys - 1, 0))))}
        internals.ingest(
            Token(
                index=index,
                token_id=1,
                text="x",
                piece="x",
                seconds=0.01,
                kv_bytes=keys * PER_TOKEN,
                kv_bytes_per_layer=(),
                attention=attention,
            )
        )
    internals.redraw(force=True)
    assert child_objects(internals) == before
    # One step per token in the state; about two points per pixel on screen, ending at the last.
    assert len(internals.state.reply.steps) == 4999
    x, y = internals.timing.step_curve.getData()
    assert x[-1] == 4999 and len(x) < 4999 / 3  # the plot is some hundred pixels wide
    assert y.max() == internals.state.reply.step_seconds.view().max()
    assert internals.kv_cache.curve.getData()[1][-1] == (PROMPT + 4999) * PER_TOKEN
    image = internals.attention.head_tile(0)
    assert image.shape[0] <= DISPLAY_ROWS and image.shape[1] <= DISPLAY_KEYS
    assert internals.state.attention[0].rows <= 64
    internals.timer.stop()


def test_docks_are_named_and_only_visible_stale_panels_redraw(qtbot, rng):
    window = QMainWindow()
    qtbot.addWidget(window)
    view = build_docks(window)
    names = sorted(dock.objectName() for dock in view.docks.values())
    assert names == sorted(
        [
            "internals_timing",
            "internals_kv_cache",
            "internals_attention",
            "internals_next_token",
            "internals_roofline",
            "internals_tokens",
            "internals_placement",
            "internals_layers",
        ]
    )
    window.show()
    qtbot.waitExposed(window)
    view.set_model(model_info())
    view.ingest(prefill(rng))
    # Nothing here calls redraw: the timer draws the timing panel, and leaves the KV panel,
    # tabified behind it, stale.
    qtbot.waitUntil(lambda: not view.timing.needs_redraw())
    assert view.kv_cache.needs_redraw()
    view.docks["kv_cache"].raise_()
    qtbot.waitUntil(lambda: not view.kv_cache.needs_redraw())
    # The saved layout finds every dock by name again.
    saved = window.saveState()
    view.docks["roofline"].setFloating(True)
    view.docks["next_token"].hide()
    assert window.restoreState(saved)
    assert not view.docks["roofline"].isFloating() and not view.docks["next_token"].isHidden()
    view.timer.stop()


def test_clear_forgets_the_conversation(view, rng):
    run_reply(view, rng, count=3)
    view.redraw(force=True)
    # Everything drawn first, so each check below fails if clearing left it in place.
    assert len(view.kv_cache.curve.getData()[0]) == 4 and view.next_token.step == 2
    assert view.attention.overview_image.image is not None and view.attention.slots
    assert view.timing.step_curve.getData()[0] is not None
    view.clear()
    view.redraw(force=True)
    for curve in (view.kv_cache.curve, view.timing.step_curve):  # drawn empty: no data
        x, _y = curve.getData()
        assert x is None or len(x) == 0
    assert view.state.replies == [] and view.state.attention == {}
    assert view.next_token.step == -1 and view.next_token.tokens.toPlainText() == ""
    assert view.attention.overview_image.image is None and view.attention.slots == ()
    assert all(panel.pages.empty for panel in view.panels)
    assert view.state.info is not None and view.state.watched_layers == (0, 1)


def test_candidate_labels_keep_one_width(view, rng):
    from ui.panels.next_token import LABEL_CHARACTERS, axis_label

    assert axis_label("short") == "short"
    long = axis_label("x" * 40)
    assert len(long) == LABEL_CHARACTERS and long.endswith("…")
    run_reply(view, rng, count=3)
    chart = view.next_token.chart
    view.next_token.show_step(0)
    view.redraw(force=True)
    left = chart.bar_rects(0)[0].left()
    view.next_token.show_step(2)
    view.redraw(force=True)
    assert chart.bar_rects(0)[0].left() == left  # new labels never move the bars


def test_the_candidate_chart_paints_each_bar_its_length_and_colour(qtbot, view, rng):
    """The pixels: each bar is as long as its probability, the chosen token's in red."""
    from PySide6.QtGui import QColor

    run_reply(view, rng, count=3)
    view.redraw(force=True)
    chart = view.next_token.chart
    chart.resize(480, 320)
    image = chart.grab().toImage()
    ratio = image.devicePixelRatio()
    area = chart.plot_rect()
    checked = 0
    for index, row in enumerate(chart.rows):
        prob, _sampled = chart.bar_rects(index)
        assert prob.width() == pytest.approx(area.width() * row.prob)
        if prob.width() < 4:
            continue
        inside = image.pixelColor(int(prob.center().x() * ratio), int(prob.center().y() * ratio))
        expected = (217, 48, 37) if row.chosen else (66, 133, 244)
        assert inside == QColor(*expected)
        after = int((prob.right() + 3) * ratio)
        if prob.right() + 3 < area.right():
            assert image.pixelColor(after, int(prob.center().y() * ratio)) == QColor(0, 0, 0)
        checked += 1
    assert checked > 0 and any(row.chosen for row in chart.rows)


def test_the_step_latency_chart_paints_each_step_where_its_latency_is(qtbot, view, rng):
    """The pixels: the curve passes through every step's (token, latency) point, inside the
    range shown, and the legend has a row of its own above the plot (it covered the curve)."""

    view.set_next_reply_label(cache_label(True))
    _first, tokens = run_reply(view, rng, count=6)
    view.redraw(force=True)
    chart = view.timing.steps_plot
    chart.resize(480, 260)
    image = chart.grab().toImage()
    ratio = image.devicePixelRatio()
    x, y = view.timing.step_curve.getData()
    np.testing.assert_array_equal(y, [t.seconds for t in tokens[1:]])
    (_x0, x1), (_y0, y1) = chart.view_range()
    assert x.max() <= x1 and y.max() <= y1
    for point_x, point_y in zip(x, y, strict=True):
        point = chart.point_at(point_x, point_y)
        near = [
            image.pixelColor(int((point.x() + dx) * ratio), int((point.y() + dy) * ratio))
            for dx in (-1, 0, 1)
            for dy in (-1, 0, 1)
        ]
        # The curve's green (52, 168, 83), perhaps blended with the black by antialiasing.
        assert any(c.green() > 60 and c.green() > 1.5 * max(c.red(), c.blue()) for c in near), (
            f"no curve at step {point_x}"
        )
    assert chart.legend_rect().bottom() <= chart.plot_rect().top()
    assert chart.legend_names() == [WITH_CACHE]


def test_the_kv_chart_paints_the_cache_size_and_the_stacked_layers(qtbot, view, rng):
    """The pixels: the total's line runs through the last event's bytes; stacked, the bands
    fill the area under the total and nothing above it."""
    from PySide6.QtGui import QColor

    _first, tokens = run_reply(view, rng, count=4)
    view.redraw(force=True)
    chart = view.kv_cache.plot_widget
    chart.resize(480, 300)

    def near(image, point, colour: QColor) -> bool:
        ratio = image.devicePixelRatio()
        return any(
            sum(abs(a - b) for a, b in zip(c.getRgb()[:3], colour.getRgb()[:3], strict=True)) < 60
            for c in (
                image.pixelColor(int((point.x() + dx) * ratio), int((point.y() + dy) * ratio))
                for dx in (-1, 0, 1)
                for dy in (-1, 0, 1)
            )
        )  # fmt: skip

    x, y = view.kv_cache.curve.getData()
    image = chart.grab().toImage()
    middle = (x[-2] + x[-1]) / 2, (y[-2] + y[-1]) / 2  # of the last step's segment
    assert near(image, chart.point_at(*middle), QColor(66, 133, 244))
    # the prompt's segment, from the empty cache to its end: half way, half its bytes
    assert (x[0], y[0]) == (0, 0)
    assert near(image, chart.point_at(x[1] / 2, y[1] / 2), QColor(66, 133, 244))
    assert y[-1] == tokens[-1].kv_bytes and y[-1] <= chart.view_range()[1][1]
    assert chart.y_title() in ("cache (B)", "cache (KiB)", "cache (MiB)")
    view.kv_cache.select_view(STACKED)
    view.redraw(force=True)
    image = chart.grab().toImage()
    ratio = image.devicePixelRatio()
    inside = chart.point_at(x[-1] - 0.5, y[-1] * 0.5)
    above = chart.point_at(x[-1] - 0.5, min(y[-1] * 1.15, chart.view_range()[1][1]))
    assert image.pixelColor(int(inside.x() * ratio), int(inside.y() * ratio)) != QColor(0, 0, 0)
    assert image.pixelColor(int(above.x() * ratio), int(above.y() * ratio)) in (
        QColor(0, 0, 0),
        QColor(70, 70, 70),  # a grid line
    )
