"""The heads of a layer as one mosaic image, and the statistics kept as rows arrive."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PySide6.QtCore import QPointF

from tests.ui.test_panels import (
    HEADS,
    LAYERS,
    PROMPT,
    causal,
    expected_matrix,
    model_info,
    prefill,
    run_reply,
    token,
)
from tests.ui.test_teaching_panels import show
from ui.panels import pooled_rows
from ui.panels.docks import InternalsView
from ui.panels.mosaic import GAP_VALUE, LEVEL_EDGES, MosaicLayout, best_columns
from ui.panels.ranges import decimate, headroom
from ui.panels.state import AttentionRows


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# -- layout ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tiles", "width", "height", "columns"),
    [
        (9, 600, 600, 3),  # a square area: 3 x 3 square tiles
        (9, 1800, 200, 9),  # a wide strip: one line
        (9, 200, 1800, 1),  # a tall strip: one column
        (9, 700, 400, 5),  # 5 + 4: tiles 140 x 200 beat 3 x 3 tiles of 233 x 133
        (1, 300, 100, 1),
        (4, 0, 0, 1),  # not laid out yet
    ],
)
def test_tile_columns_make_the_largest_readable_tiles(tiles, width, height, columns):
    assert best_columns(tiles, width, height) == columns


def test_layout_places_each_tile_apart_and_maps_pixels_back(rng):
    data = rng.random((5, 40, 70)).astype(np.float32) + 0.1
    scale = np.array([1.0, 2.0, 0.5, 1.0, 4.0])
    layout = MosaicLayout(tiles=5, data_rows=40, data_columns=70, columns_of_tiles=3)
    image = layout.compose(data, scale, None)
    assert image.shape == layout.shape and image.dtype == np.float32
    up_rows, up_columns = layout.upsample
    assert (up_rows, up_columns) == (2, 1)  # 40 rows are repeated up to 64 pixels or more
    # Every pixel of every tile is its cell times the tile's scale; nothing else is written.
    covered = np.zeros(image.shape, dtype=bool)
    for slot in range(5):
        y, x = layout.origin(slot)
        height, width = layout.tile_shape
        expected = np.repeat(data[slot] * np.float32(scale[slot]), up_rows, axis=0)
        np.testing.assert_allclose(image[y : y + height, x : x + width], expected, rtol=1e-6)
        assert not covered[y : y + height, x : x + width].any()  # tiles never overlap
        covered[y : y + height, x : x + width] = True
        np.testing.assert_allclose(layout.tile(image, slot), data[slot] * scale[slot], rtol=1e-6)
        # Pixel centres map back to their tile and cell; the gap right of a tile to none.
        for row, column in ((0, 0), (39, 69), (17, 3)):
            found = layout.locate(y + row * up_rows + 0.5, x + column + 0.5)
            assert found is not None
            assert (found[0], math.floor(found[1] / up_rows), math.floor(found[2])) == (
                slot,
                row,
                column,
            )
        if slot % 3 < 2:
            assert layout.locate(y + 1, x + width + 0.5) is None
    assert np.all(image[~covered] == GAP_VALUE)  # gaps and the empty sixth place: background
    assert layout.locate(*[v + 1 for v in layout.origin(5)]) is None  # no sixth head


# -- the panel ---------------------------------------------------------------------------------


def test_the_heads_are_one_image_with_each_weight_in_its_place(view, rng):
    panel = view.attention
    panel.per_head_scale.setChecked(False)  # pixels are the weights themselves
    panel.mosaic.resize(640, 360)
    first, tokens = run_reply(view, rng, count=4)
    view.redraw(force=True)
    assert panel.slots == tuple(range(HEADS))
    expected = expected_matrix(first, tokens, 0)
    keys = PROMPT + len(tokens) - 1
    layout = panel.layout
    up_rows, up_columns = layout.upsample
    for slot, head in enumerate(panel.slots):
        top, left = layout.origin(slot)
        for row in range(keys):
            for key in range(keys):
                y, x = top + row * up_rows, left + key * up_columns
                assert panel.mosaic.image[y, x] == expected[head, row, key]
                # The pointer over that pixel names the same head, query and key.
                centre = panel.mosaic.image_to_view(QPointF(x + 0.5, y + 0.5))
                assert panel.cell_at(centre) == (head, row, key)
    # Hover says which head, which two tokens and the weight.
    top, left = layout.origin(2)
    pixel = QPointF(left + 5 * up_columns + 0.5, top + 6 * up_rows + 0.5)
    point = panel.mosaic.image_to_view(pixel)
    text = panel.describe(*panel.cell_at(point))
    assert text == f"head 2 · query #6 't1' → key #5 't0': {expected[2, 6, 5]:.4f}"
    # Each head is labelled on its own tile.
    labels = panel.mosaic.labels
    assert [text for text, _corner in labels] == [f"head {h}" for h in range(HEADS)]
    for slot, (_text, corner) in enumerate(labels):
        found = panel.cell_at(QPointF(corner.x() - 1e-3, corner.y() + 1e-3))
        assert found is not None and found[0] == slot  # its tile's top-right corner


def test_pooled_cells_map_hover_to_the_rows_and_keys_they_cover(view, rng, monkeypatch):
    monkeypatch.setattr(pooled_rows, "DISPLAY_ROWS", 4)
    monkeypatch.setattr(pooled_rows, "DISPLAY_KEYS", 6)
    panel = view.attention
    run_reply(view, rng, count=12)  # 16 rows and keys
    view.redraw(force=True)
    rows = view.state.attention[0]
    row_factor, key_factor = panel.pool_factors
    assert (row_factor, key_factor) == (4, 4)  # powers of two: 16 rows / 4, 16 keys / 6
    layout = panel.layout
    assert (layout.data_rows, layout.data_columns) == (4, 4)
    up_rows, up_columns = layout.upsample
    top, left = layout.origin(1)
    for cell_row in range(layout.data_rows):
        for cell_key in range(layout.data_columns):
            y, x = top + cell_row * up_rows, left + cell_key * up_columns
            centre = panel.mosaic.image_to_view(QPointF(x + 0.5, y + 0.5))
            head, row, key = panel.cell_at(centre)
            assert head == 1
            assert cell_row * row_factor <= row < (cell_row + 1) * row_factor
            assert cell_key * key_factor <= key < (cell_key + 1) * key_factor
            block = rows.matrix()[1, row_factor * cell_row : row_factor * (cell_row + 1)]
            cell = block[:, key_factor * cell_key : key_factor * (cell_key + 1)]
            assert panel.head_tile(1)[cell_row, cell_key] == pytest.approx(cell.max(), rel=1e-6)


def test_one_head_fills_the_mosaic_and_labels_follow(view, rng):
    first, tokens = run_reply(view, rng, count=3)
    view.attention.select(1, head=3)
    view.redraw(force=True)
    panel = view.attention
    assert panel.slots == (3,) and panel.layout.tiles == 1
    view.redraw(force=True)
    shown = [text for text, _corner in panel.mosaic.labels]
    assert shown == ["head 3"]
    panel.select(1)  # all heads again
    view.redraw(force=True)
    shown = [text for text, _corner in panel.mosaic.labels]
    assert shown == [f"head {h}" for h in range(HEADS)] and panel.layout.tiles == HEADS
    panel.select(1, head=3)
    view.redraw(force=True)
    np.testing.assert_allclose(panel.head_tile(3), expected_matrix(first, tokens, 1)[3], rtol=1e-6)


# -- statistics kept as rows arrive --------------------------------------------------------------


def test_colour_levels_are_a_histogram_equal_to_one_built_from_scratch(rng, monkeypatch):
    """Rows stream in, pooling factors change and old rows drop: at every step the kept counts
    equal np.histogram of the pooled image, and the level brackets np.quantile."""
    monkeypatch.setattr(pooled_rows, "DISPLAY_ROWS", 8)
    monkeypatch.setattr(pooled_rows, "DISPLAY_KEYS", 12)
    rows = AttentionRows(HEADS, max_rows=20)
    pooled = pooled_rows.PooledRows()
    rows.append_block(causal(rng, 6, 6))
    one_bin = LEVEL_EDGES[-1] / LEVEL_EDGES[-2]
    factors = set()
    for keys in range(7, 90):
        rows.append_row(causal(rng, 1, keys)[:, 0, :])
        image, row_factor, key_factor = pooled.update(rows)
        factors.add((row_factor, key_factor))
        levels = pooled.levels()
        for head in range(HEADS):
            weights = image[head][image[head] > 0]
            counts, _edges = np.histogram(weights, bins=LEVEL_EDGES)
            np.testing.assert_array_equal(pooled.histogram.total[head], counts)
            ordered = np.sort(weights)
            rank = 0.99 * (ordered.size - 1)
            low, high = ordered[math.floor(rank)], ordered[math.ceil(rank)]
            assert low / one_bin <= levels[head] <= high * one_bin
    assert rows.dropped > 0 and len(factors) >= 3  # drops and re-pooling both happened


def test_a_frame_never_sorts_or_takes_quantiles_of_the_history(view, rng, monkeypatch):
    run_reply(view, rng, count=3)

    def forbidden(*_args, **_kwargs):
        raise AssertionError("a frame must not sort the weights")

    monkeypatch.setattr(np, "quantile", forbidden)
    monkeypatch.setattr(np, "percentile", forbidden)
    monkeypatch.setattr(np, "sort", forbidden)
    view.redraw(force=True)
    assert view.attention.tile_scale.size == HEADS


def test_overview_statistics_equal_a_computation_from_the_events(rng):
    """Mean max weight and mean normalised entropy per head, over every row of the reply,
    including rows the bounded buffer has dropped, against a plain loop over the events."""
    internals = InternalsView(max_attention_rows=6)
    internals.timer.stop()
    internals.set_model(model_info())
    internals.set_watched_layers((0, 1))
    first, tokens = run_reply(internals, rng, count=25)
    assert internals.state.attention[1].dropped > 0
    # The rows each query contributed: the prompt's, then one per later token (token 0
    # re-reads the last prompt row, so it adds none).
    rows = [(p, first.attention[1][:, p, : p + 1]) for p in range(PROMPT)]
    rows += [(t.attention[1].shape[1] - 1, t.attention[1]) for t in tokens[1:]]
    max_weight = np.zeros(HEADS)
    entropy = np.zeros(HEADS)
    for position, row in rows:
        for head in range(HEADS):
            weights = [float(w) for w in row[head] if w > 0]
            max_weight[head] += max(weights)
            h = -sum(w * math.log(w) for w in weights)
            entropy[head] += h / math.log(max(position + 1, 2))
    stats = internals.state.head_stats[1]
    assert stats.rows == len(rows) == PROMPT + 24
    np.testing.assert_allclose(stats.mean("max"), max_weight / len(rows), rtol=1e-5)
    np.testing.assert_allclose(stats.mean("entropy"), entropy / len(rows), rtol=1e-4)
    internals.redraw(force=True)
    overview = internals.attention.overview_image.image
    assert overview.shape == (LAYERS, HEADS)
    np.testing.assert_allclose(overview[1], max_weight / len(rows), rtol=1e-5)


# -- ranges ------------------------------------------------------------------------------------


def test_headroom_keeps_a_range_while_the_data_fits_it():
    assert headroom(0.0, 10.0) == 12.5
    assert headroom(12.5, 12.0) == 12.5  # still fits
    assert headroom(12.5, 13.0) == pytest.approx(16.25)  # outgrown: room to grow again
    assert headroom(100.0, 10.0) == 12.5  # a new reply far smaller: a range of its own
    assert headroom(5.0, 0.0) == 5.0


def test_growing_curves_change_their_range_a_few_times_not_every_frame(view, rng):
    steps, kv = view.timing.steps_plot, view.kv_cache.plot_widget
    view.ingest(prefill(rng))
    frames = 200
    for index in range(frames):
        view.ingest(token(rng, index, layers=()))
        view.redraw(force=True)
    assert 0 < steps.range_changes < frames / 5 and 0 < kv.range_changes < frames / 5
    # Yet every point is inside the range shown.
    (x0, x1), (y0, y1) = steps.view_range()
    x, y = view.timing.step_curve.getData()
    assert x0 <= x.min() and x.max() <= x1 and y0 <= y.min() and y.max() <= y1
    (x0, x1), (y0, y1) = kv.view_range()
    x, y = view.kv_cache.curve.getData()
    assert x0 <= x.min() and x.max() + 1 <= x1 and y0 <= y.min() and y.max() <= y1


def test_decimated_curves_keep_peaks_and_end_at_the_newest_point(rng):
    x = np.arange(1, 10_001, dtype=np.float64)
    y = rng.random(x.size)
    y[5_000] = 9.0  # one slow step among thousands
    shown_x, shown_y = decimate(x, y, pixels=400)
    assert shown_x.size <= 2 * 400 + 25 and shown_x[-1] == x[-1] and shown_y[-1] == y[-1]
    assert shown_y.max() == 9.0 and shown_y.min() == y.min()  # the envelope is kept
    assert np.all(np.diff(shown_x) >= 0)
    every, values = decimate(x, x * 2, pixels=400, peak=False)
    assert every[-1] == x[-1] and values[-1] == 2 * x[-1] and every.size <= 400 + 25
    np.testing.assert_array_equal(values, every * 2)  # points of the series itself
    small_x, small_y = decimate(x[:300], y[:300], pixels=400)
    np.testing.assert_array_equal(small_x, x[:300])  # short: unchanged
    np.testing.assert_array_equal(small_y, y[:300])


def test_pooling_starts_over_only_when_the_context_doubles(rng):
    """Filling and halving the row buffer, and a growing context, keep the pooled cells: a
    full re-pool (tens of milliseconds at 10,000 keys) happens once per doubling."""
    rows = AttentionRows(HEADS, max_rows=64)
    pooled = pooled_rows.PooledRows()
    rows.append_block(causal(rng, 4, 4))
    restarts, key = 0, None
    for keys in range(5, 700):
        rows.append_row(causal(rng, 1, keys)[:, 0, :])
        pooled.update(rows, max_rows=20, max_keys=40)
        restarts += pooled._key != key
        key = pooled._key
    assert rows.dropped > 5 * 32  # the buffer filled and halved many times
    assert restarts <= 2 * math.log2(700 / 4)  # row and key factors: once per doubling each


@pytest.mark.parametrize("factor", [1, 2, 6, 7, 8, 24, 48, 64])
def test_max_pooling_keys_takes_the_largest_of_each_run(rng, factor):
    block = rng.random((3, 5, 4 * factor)).astype(np.float32)
    expected = block.reshape(3, 5, 4, factor).max(axis=3)
    np.testing.assert_array_equal(pooled_rows.max_pool_keys(block, factor), expected)


@pytest.mark.parametrize(("rows", "factor"), [(8, 1), (8, 2), (9, 2), (7, 4), (5, 8)])
def test_max_pooling_rows_takes_the_largest_of_each_run_the_last_maybe_short(rng, rows, factor):
    block = rng.random((3, rows, 6)).astype(np.float32)
    starts = np.arange(0, rows, factor)
    expected = np.maximum.reduceat(block, starts, axis=1)
    np.testing.assert_array_equal(pooled_rows.max_pool_rows(block, factor), expected)


def test_the_mosaic_is_painted_from_32_bit_pixels_equal_to_its_colour_table(view, rng):
    """Qt paints an Indexed8 image by converting it at every paint (in its thread pool, beside
    the model): the mosaic converts once per new image, and each pixel is still the colour
    table's entry for its weight."""
    from PySide6.QtGui import QImage

    from ui.panels.mosaic import MOSAIC_LEVELS

    panel = view.attention
    panel.mosaic.resize(640, 360)
    run_reply(view, rng, count=4)
    view.redraw(force=True)
    image = panel.mosaic.qimage
    assert image.format() == QImage.Format.Format_RGB32
    height, width = panel.mosaic.image.shape
    assert (image.width(), image.height()) == (width, height)
    pixels = np.frombuffer(image.constBits(), np.uint32, height * image.bytesPerLine() // 4)
    pixels = pixels.reshape(height, -1)[:, :width]
    # weights to table entries as pyqtgraph mapped them (levels, then 256 colours)
    low, high = MOSAIC_LEVELS
    scaled = (panel.mosaic.image - low) * (256 / (high - low))
    entries = np.clip(scaled, 0, 255).astype(np.uint8)
    table = panel.mosaic.lut
    expected = (0xFF << 24) | (table[:, 0].astype(np.uint32) << 16)
    expected = expected | (table[:, 1].astype(np.uint32) << 8) | table[:, 2]
    np.testing.assert_array_equal(pixels, expected[entries])


def reply_on_screen(qtbot, view: InternalsView, rng, per_head_scale: bool = True):
    """The attention dock shown after a four-token reply: (prefill, tokens)."""
    show(view, "attention")
    qtbot.waitExposed(view.docks["attention"])
    view.attention.per_head_scale.setChecked(per_head_scale)
    first, tokens = run_reply(view, rng, count=4)
    view.redraw(force=True)
    return first, tokens


def cell_on_screen(panel, slot: int, row: float, key: float) -> QPointF:
    """Where the centre of cell (row, key) of tile `slot` is in the mosaic widget's pixels."""
    top, left = panel.layout.origin(slot)
    up_rows, up_columns = panel.layout.upsample
    pixel = QPointF(left + (key + 0.5) * up_columns, top + (row + 0.5) * up_rows)
    return panel.mosaic.map_from_view(panel.mosaic.image_to_view(pixel))


def test_each_cell_is_painted_in_its_colour_where_the_pointer_reads_it(qtbot, view, rng):
    """On screen, the centre of every cell of every tile has that cell's colour, and the
    pointer there names that head, row and key."""
    first, tokens = reply_on_screen(qtbot, view, rng, per_head_scale=False)
    panel = view.attention
    expected = expected_matrix(first, tokens, 0)
    screen = panel.mosaic.grab().toImage()
    table = panel.mosaic.lut
    low, high = panel.mosaic.levels
    keys = PROMPT + len(tokens) - 1
    mosaic = panel.mosaic
    labels = [mosaic.label_rect(text, mosaic.map_from_view(at)) for text, at in mosaic.labels]
    checked = 0
    for slot, head in enumerate(panel.slots):
        for row in range(keys):
            for key in range(keys):
                at = cell_on_screen(panel, slot, row, key)
                entry = min(max(int((expected[head, row, key] - low) * 256 / (high - low)), 0), 255)
                assert panel.cell_at(panel.mosaic.map_to_view(at)) == (head, row, key)
                if any(label.contains(at) for label in labels):
                    continue  # under a head's name
                checked += 1
                colour = screen.pixelColor(at.toPoint())
                assert (colour.red(), colour.green(), colour.blue()) == tuple(table[entry][:3])
    assert checked > 0.8 * len(panel.slots) * keys * keys


def point_at(panel, at: QPointF) -> None:
    """Move the pointer over the mosaic to `at` (its widget's pixels), as a mouse would."""
    from PySide6.QtCore import QEvent, Qt
    from PySide6.QtGui import QMouseEvent
    from PySide6.QtWidgets import QApplication

    moved = QMouseEvent(
        QEvent.Type.MouseMove,
        at,
        panel.mosaic.mapToGlobal(at),
        Qt.MouseButton.NoButton,
        Qt.MouseButton.NoButton,
        Qt.KeyboardModifier.NoModifier,
    )
    QApplication.sendEvent(panel.mosaic, moved)


def test_the_pointer_over_a_cell_writes_its_weight_under_the_mosaic(qtbot, view, rng):
    first, tokens = reply_on_screen(qtbot, view, rng)
    panel = view.attention
    expected = expected_matrix(first, tokens, 0)
    for row, key, query, word in ((7, 2, "t2", "p2"), (6, 5, "t1", "t0")):  # head 3's cells
        point_at(panel, QPointF(cell_on_screen(panel, 3, row, key).toPoint()))
        text = f"head 3 · query #{row} '{query}' → key #{key} '{word}': "
        assert panel.hover.text() == text + f"{expected[3, row, key]:.4f}"


def test_a_drag_across_the_mosaic_opens_no_head_and_a_click_does(qtbot, view, rng):
    from PySide6.QtCore import Qt

    reply_on_screen(qtbot, view, rng)
    panel = view.attention
    mosaic, left = panel.mosaic, Qt.MouseButton.LeftButton

    def tile_centre(slot: int):
        middle = (panel.layout.data_rows - 1) / 2, (panel.layout.data_columns - 1) / 2
        return cell_on_screen(panel, slot, *middle).toPoint()

    qtbot.mousePress(mosaic, left, pos=tile_centre(0))
    qtbot.mouseMove(mosaic, tile_centre(1))
    qtbot.mouseRelease(mosaic, left, pos=tile_centre(1))
    assert panel.selected_head is None
    qtbot.mouseClick(mosaic, left, pos=tile_centre(1))
    assert panel.selected_head == panel.slots[1]
