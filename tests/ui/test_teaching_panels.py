"""Panels a person can learn from: what each shows before the first reply, the roofline of each
phase with the events' own numbers, attention one can read, and bars that keep off their labels."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from PySide6.QtCore import QPointF, QRectF, Qt

from engine.events import Peaks, Roofline
from tests.ui.test_panels import PER_TOKEN, PROMPT, model_info, prefill, run_reply, token
from ui.panels import roofline as roofline_panel
from ui.panels.docks import InternalsView
from ui.panels.head_overview import label_step
from ui.panels.kv_cache import formula_text, human_bytes
from ui.panels.roofline import DECODE_POINTS, phase_sentence

PEAKS = Peaks(
    peak_flops_per_s=2.0e11,
    peak_bytes_per_s=2.0e10,  # ridge at 10 FLOP/byte
    dtype="bfloat16",
    device="cpu",
    method="best of 5 2048x2048 matmuls; a 256 MiB copy",
)


@pytest.fixture
def rng():
    return np.random.default_rng(11)


def show(view: InternalsView, name: str, width: int = 700, height: int = 560) -> None:
    dock = view.docks[name]
    dock.setFloating(True)
    dock.resize(width, height)
    dock.show()


# -- empty states ----------------------------------------------------------------------------


def test_before_the_first_reply_every_panel_says_what_it_will_show(view, rng):
    view.redraw(force=True)
    for panel in view.panels:
        assert panel.pages.empty, panel
        message = panel.pages.message.text()
        assert "Send a message" in message and len(message) > 150, message
    # The KV panel already teaches the formula, with the MQA and MHA lines beside GQA.
    text = view.kv_cache.formula.text()
    assert "multi-query attention, 1 K/V head" in text and "multi-head attention" in text
    run_reply(view, rng, count=3)
    view.redraw(force=True)
    for panel in view.panels:
        # these events carry no roofline (see below) and no placement (a model wholly in RAM);
        # the layers panel draws the lens an engine answers (tests/ui/test_layers_panel.py)
        if panel not in (view.roofline, view.placement, view.layers):
            assert not panel.pages.empty, panel


def test_kv_sharing_lines_count_mha_gqa_and_mqa():
    info = model_info()  # 4 query heads, 2 K/V heads
    lines = formula_text(info, 9, 9 * PER_TOKEN).splitlines()
    assert f"• multi-head attention, 4 K/V heads: {human_bytes(2 * 9 * PER_TOKEN)}" in lines
    gqa = next(line for line in lines if line.startswith("• grouped-query"))
    assert human_bytes(9 * PER_TOKEN) in gqa and "(this model)" in gqa and "(4/2 = 2x)" in gqa
    assert f"• multi-query attention, 1 K/V head: {human_bytes(9 * PER_TOKEN // 2)}" in lines
    # A multi-query model says so, and what it saves.
    mqa = formula_text(replace(info, kv_heads=1), 9, None)
    assert "1 K/V head: 1.1 KiB (this model): multi-query attention saves 3.4 KiB (4/1 = 4x)" in mqa
    assert "grouped-query" not in mqa
    # Before any reply: the full context.
    assert "a full 64-token context" in formula_text(info, 0, None)


# -- roofline --------------------------------------------------------------------------------


def roofline(flops: int, moved: int, seconds: float) -> Roofline:
    intensity = flops / moved
    return Roofline(
        flops=flops,
        bytes=moved,
        intensity=intensity,
        flops_per_s=flops / seconds,
        bytes_per_s=moved / seconds,
        bound="compute" if intensity >= 10 else "memory",
    )


def roofline_reply(view: InternalsView, rng, steps: int) -> tuple[Roofline, list[Roofline]]:
    first = replace(prefill(rng), roofline=roofline(9_000_000, 300_000, 0.001))
    view.ingest(first)
    decodes = []
    for index in range(steps):
        counted = roofline(1_900_000 + 1000 * index, 1_000_000, 0.0001) if index else None
        view.ingest(replace(token(rng, index), roofline=counted))
        if counted is not None:
            decodes.append(counted)
    return first.roofline, decodes


@pytest.fixture
def measured(view):
    view.set_model(model_info(peaks=PEAKS))
    return view


def test_roofline_plots_and_quotes_exactly_the_events_numbers(measured, rng):
    view = measured
    show(view, "roofline")
    first, decodes = roofline_reply(view, rng, steps=6)
    panel = view.roofline
    before = panel.decode_points.getData()[0]
    view.redraw(force=True)
    assert before is None or len(before) == 0  # ingesting drew nothing: the timer draws
    assert not panel.pages.empty
    # The items hold the events' numbers; the log-log axes take their logarithms to draw.
    x, y = panel.prefill_points.xData, panel.prefill_points.yData
    np.testing.assert_array_equal(x, [first.intensity])
    np.testing.assert_array_equal(y, [first.flops_per_s])
    x, y = panel.decode_points.xData, panel.decode_points.yData
    np.testing.assert_array_equal(x, [r.intensity for r in decodes])  # one point per step
    np.testing.assert_array_equal(y, [r.flops_per_s for r in decodes])
    # One sentence per phase, from the same numbers and the measured peaks.
    text = panel.phases.text()
    share = decodes[-1].bytes_per_s / PEAKS.peak_bytes_per_s
    assert (
        f"decode: {decodes[-1].intensity:.3g} FLOP/byte, {share:.0%} of measured bandwidth" in text
    )
    assert "memory-bound" in text
    compute = first.flops_per_s / PEAKS.peak_flops_per_s
    assert f"prefill: {first.intensity:.3g} FLOP/byte, {compute:.0%} of measured compute" in text
    assert "compute-bound" in text
    assert PEAKS.method in panel.peaks.text() and "ridge at 10 FLOP/byte" in panel.peaks.text()
    # The roof: the bandwidth slope up to the ridge, then the compute ceiling.
    slope_x, slope_y = panel.bandwidth_line.xData, panel.bandwidth_line.yData
    np.testing.assert_allclose(slope_y, np.asarray(slope_x) * PEAKS.peak_bytes_per_s)
    assert slope_x[-1] == pytest.approx(10.0)
    ceiling_x, ceiling_y = panel.compute_line.xData, panel.compute_line.yData
    assert ceiling_x[0] == pytest.approx(10.0) and set(ceiling_y) == {PEAKS.peak_flops_per_s}
    # Every point lies inside the view's range (log10 units).
    (x_low, x_high), (y_low, y_high) = panel.chart.view_range()
    for intensity, rate in [(first.intensity, first.flops_per_s), (10.0, PEAKS.peak_flops_per_s)]:
        assert x_low < np.log10(intensity) < x_high and y_low < np.log10(rate) < y_high
    # The key sits above the chart, not over its data (a legend inside covered the roof).
    for name in ("memory bandwidth", "compute ceiling", "prefill (each reply)", "decode steps"):
        assert name in panel.key.text()
    assert panel.key.geometry().bottom() < panel.chart.geometry().top()


def test_roofline_keeps_each_replys_prefill_and_the_latest_decode_cloud(measured, rng):
    view = measured
    first, _decodes = roofline_reply(view, rng, steps=3)
    second, decodes = roofline_reply(view, rng, steps=DECODE_POINTS + 20)
    view.redraw(force=True)
    panel = view.roofline
    x = panel.prefill_points.xData
    np.testing.assert_array_equal(x, [first.intensity, second.intensity])
    x = panel.decode_points.xData
    assert len(x) == DECODE_POINTS  # the latest steps, bounded
    np.testing.assert_array_equal(x, [r.intensity for r in decodes[-DECODE_POINTS:]])
    view.clear()
    view.redraw(force=True)
    assert panel.pages.empty


def test_a_phase_sentence_without_peaks_still_gives_the_events_numbers():
    counted = roofline(2_000, 1_000, 0.5)
    sentence = phase_sentence("decode", counted, None)
    assert sentence.startswith("decode: 2 FLOP/byte (4 kFLOP/s, 2 kB/s): memory-bound")


# -- attention -------------------------------------------------------------------------------


def tile_on_screen(view: InternalsView, slot: int) -> QRectF:
    panel = view.attention
    y, x = panel.layout.origin(slot)
    height, width = panel.layout.tile_shape
    key_size, row_size = panel._pixel
    mosaic = panel.mosaic
    top_left = mosaic.map_from_view(QPointF(x * key_size, y * row_size))
    bottom_right = mosaic.map_from_view(QPointF((x + width) * key_size, (y + height) * row_size))
    return QRectF(top_left, bottom_right)


def test_prefill_tiles_have_square_cells_and_a_click_opens_one_head(qtbot, view, rng):
    show(view, "attention")
    view.ingest(prefill(rng, prompt=PROMPT))
    view.redraw(force=True)
    panel = view.attention
    assert len(panel.slots) == 4
    for slot in range(4):
        tile = tile_on_screen(view, slot)
        assert tile.width() == pytest.approx(tile.height(), rel=0.02)  # 5 x 5 cells, square
        assert panel.mosaic.plot_rect().adjusted(-1, -1, 1, 1).contains(tile)
    assert not panel.key_axis.shown  # four heads: tokens on hover only
    # Click head 2's tile: it alone, large, with its tokens on both axes.
    centre = tile_on_screen(view, 2).center()
    qtbot.mouseClick(panel.mosaic, Qt.MouseButton.LeftButton, pos=centre.toPoint())
    view.redraw(force=True)
    assert panel.slots == (2,) and panel.selected_head == 2 and panel.all_heads.isVisible()
    assert tile_on_screen(view, 0).width() > 1.8 * tile.width()
    assert panel.key_axis.shown and panel.query_axis.shown
    labels = [text for _position, text in panel.key_axis.ticks]
    assert labels == [f"p{i}" for i in range(PROMPT)]
    # The way back.
    panel.all_heads.click()
    view.redraw(force=True)
    assert len(panel.slots) == 4 and not panel.all_heads.isVisible()
    assert not panel.key_axis.shown


def test_long_contexts_keep_decode_rows_readable(view, rng):
    show(view, "attention")
    prompt = 1200
    view.ingest(prefill(rng, prompt=prompt))
    for index in range(40):
        view.ingest(token(rng, index, prompt=prompt))
    view.redraw(force=True)
    panel = view.attention
    rows = view.state.attention[0]
    assert rows.rows < rows.keys / 4  # the latest rows of a long context: a flat strip
    tile = tile_on_screen(view, 0)
    assert tile.height() >= 0.24 * tile.width()  # stretched to stay readable, not a line
    panel.show_head(1)
    view.redraw(force=True)
    assert not panel.key_axis.shown  # 1,240 keys: too many to label, hover reads them


def test_overview_shows_every_head_and_says_what_its_colour_means(view, rng):
    show(view, "attention", width=320, height=560)  # a narrow dock
    run_reply(view, rng, count=3)
    view.redraw(force=True)
    panel = view.attention
    grid = panel.overview
    assert grid.image is not None and grid.image.shape[1] == 4  # all four heads
    heads = [text for _column, text in grid.column_labels]
    assert heads == ["0", "1", "2", "3"]  # each head labelled
    assert 0 < grid.plot_rect().right() <= grid.width()
    caption = panel.overview_caption.text()
    assert caption.startswith("Colour: mean max weight") and "strongest key" in caption


# -- next token ------------------------------------------------------------------------------


def test_next_token_key_sits_outside_the_bars(view, rng):
    show(view, "next_token")
    run_reply(view, rng, count=3)
    view.redraw(force=True)
    panel = view.next_token
    assert panel.key.geometry().bottom() < panel.chart.geometry().top()  # above the chart
    assert "model probability" in panel.key.text() and "top-k" in panel.key.text()
    assert panel.key.isVisible()
    line = panel.fontMetrics().height()
    rows = len(view.state.top_k[-1])
    assert panel.chart.plot_rect().height() >= rows * line  # a row per candidate, a line high


def test_timeline_key_sits_outside_the_timeline(view, rng):
    show(view, "timing")
    run_reply(view, rng, count=3)
    view.redraw(force=True)
    timing = view.timing
    assert timing.phase_key.geometry().bottom() < timing.timeline.geometry().top()  # above it
    assert [name in timing.phase_key.text() for name in ("tokenize", "prefill", "decode")] == [
        True
    ] * 3
    assert timing.phase_key.isVisible()


def test_the_decode_cloud_redraws_on_the_timer_not_per_token(measured, rng, monkeypatch):
    monkeypatch.setattr(roofline_panel, "CLOUD_INTERVAL_S", 3600.0)
    view = measured
    show(view, "roofline")
    roofline_reply(view, rng, steps=4)
    panel = view.roofline
    assert panel.needs_redraw()  # a new reply: at once
    panel.redraw()
    drawn = len(panel.decode_points.xData)
    view.ingest(replace(token(rng, 4), roofline=roofline(2_000_000, 1_000_000, 0.0001)))
    assert panel.tracker.stale and not panel.needs_redraw()  # a step alone waits its turn
    view.redraw(force=True)
    assert len(panel.decode_points.xData) == drawn
    monkeypatch.setattr(roofline_panel, "CLOUD_INTERVAL_S", 0.0)
    assert panel.needs_redraw()
    view.redraw(force=True)
    assert len(panel.decode_points.xData) == drawn + 1


def test_token_axes_that_would_crowd_their_own_tile_stay_hidden_frame_after_frame(qtbot, view, rng):
    """36 tokens: each has its 12 pixels while the axes are hidden, not once their labels take
    their room. The axes stay hidden and the panel settles (judged on the room they leave
    hidden, they showed, crowded the tile, hid, and showed again at every frame)."""
    from ui.panels.attention import TOKEN_LABEL_PIXELS
    from ui.panels.attention_tiles import axis_token, tile_aspect

    show(view, "attention", width=480, height=900)
    words = tuple(f"forecast{i}" for i in range(36))
    view.ingest(replace(prefill(rng, prompt=36), token_texts=words))
    panel = view.attention
    panel.show_head(0)
    for _ in range(6):
        view.redraw()
        qtbot.wait(5)
    mosaic, needed = panel.mosaic, TOKEN_LABEL_PIXELS * 36
    hidden = mosaic.area_for((), keys=False)
    shown = mosaic.area_for([(0.5, axis_token(words[0]))], keys=True)
    aspect = tile_aspect(36, 36)
    assert min(hidden.width(), hidden.height() / aspect) >= needed  # room while hidden
    assert min(shown.width(), shown.height() / aspect) < needed  # none beside the labels
    assert not panel.key_axis.shown and not panel.query_axis.shown
    assert not panel.needs_redraw()


def test_a_lone_heads_top_axis_numbers_keys_whose_words_would_collide(qtbot, view, rng):
    show(view, "attention", width=480, height=900)
    long_words = tuple(f"forecast{i}" for i in range(12))
    view.ingest(replace(prefill(rng, prompt=12), token_texts=long_words))
    panel = view.attention
    panel.show_head(0)
    view.redraw(force=True)
    qtbot.wait(20)  # the mosaic shown for the first time gets its size: a resize redraws it
    view.redraw()
    assert 12 * 12 <= panel.mosaic.plot_rect().width() < 12 * 60  # room for rows, not words
    assert panel.query_axis.shown and panel.key_axis.shown
    rows = [text for _position, text in panel.query_axis.ticks]
    assert rows == ["forecas…" if len(w) > 8 else w for w in long_words]
    top = [text for _position, text in panel.key_axis.ticks]
    assert top == [f"#{k}" for k in range(12)]  # words too wide for their columns


def test_overview_labels_thin_out_rather_than_collide():
    assert label_step(9, 400, 20) == 1  # 44 px a head: every label
    assert label_step(32, 300, 20) == 3  # 9 px a head: every third
    assert label_step(0, 300, 20) == 1
