"""The Placement panel and the picker's placement: fed events, drawn from the timer."""

from __future__ import annotations

import dataclasses
from dataclasses import replace

import numpy as np
import pytest

from engine.events import Placement, Token, Transfer
from engine.settings import LoadRequest
from tests.ui.test_panels import model_info, prefill, token
from tests.ui.test_teaching_panels import PEAKS, roofline, show
from ui.model_picker import ModelPicker
from ui.panels.placement import place_name
from ui.panels.state import PLACEMENT, InternalsState
from ui.panels.state.placement import BYTES, PREDICTED_STEP_S, STEP_S, TRANSFER_S

MB = 1_000_000
PLACED = Placement(
    layer_places=("cpu",) * 9 + ("disk",) * 21,
    layer_bytes=(13 * MB,) * 30,
    place_bytes=(("cpu", 240 * MB), ("disk", 297 * MB)),
    moved_bytes=297 * MB,
    read_bytes_per_s=5e9,
    execution_device="cpu",
    compute_s=0.041,
)


def moved(event: Token, step_s: float, transfer_s: float, bytes_: int = 610 * MB) -> Token:
    transfer = Transfer(bytes_, transfer_s, PLACED.predicted_transfer_s, PLACED.predicted_step_s)
    return dataclasses.replace(event, seconds=step_s, transfer=transfer)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def test_state_keeps_each_steps_transfer_and_says_what_bounds_it(rng):
    state = InternalsState()
    state.set_model(model_info(placement=PLACED))
    assert "will read 297 MB" in state.placement.sentence()
    assert "of a 100 ms step" in state.placement.sentence()  # 41 ms compute + 59 ms read
    state.ingest(prefill(rng))
    before = state.revision(PLACEMENT)
    state.ingest(token(rng, 0))  # token 0 came from the prefill: no transfer
    assert state.revision(PLACEMENT) == before and len(state.placement.steps) == 0
    state.ingest(moved(token(rng, 1), step_s=0.100, transfer_s=0.082))
    assert state.revision(PLACEMENT) > before
    row = state.placement.steps.view()[-1]
    assert (row[STEP_S], row[TRANSFER_S], row[BYTES]) == (0.100, 0.082, 610 * MB)
    assert row[PREDICTED_STEP_S] == pytest.approx(0.041 + 297 * MB / 5e9)
    sentence = state.placement.sentence()
    assert sentence.startswith("82% of this step (100 ms) moved 610 MB from disk")
    assert "predicted 59 ms" in sentence and "moving weights bounds it" in sentence
    assert "the step predicted 100 ms" in sentence
    state.ingest(moved(token(rng, 2), step_s=0.100, transfer_s=0.020))
    assert "compute bounds it" in state.placement.sentence()


def test_the_fast_models_disk_is_the_mapped_file_and_its_page_cache(rng):
    state = InternalsState()
    state.set_model(model_info(placement=replace(PLACED, mapped=True)))
    assert "compute from the mapped file" in state.placement.sentence()
    assert "5.0 GB/s measured at load" in state.placement.sentence()
    state.ingest(prefill(rng))
    cached = Transfer(0, 0.0004, 0.0, 0.041)
    state.ingest(dataclasses.replace(token(rng, 1), seconds=0.043, transfer=cached))
    sentence = state.placement.sentence()
    assert sentence.startswith("This step (43 ms) read nothing from disk")
    assert "all 297 MB" in sentence and "compute bounds it (predicted 41 ms)" in sentence
    dropped = Transfer(290 * MB, 0.060, 0.058, 0.099)
    state.ingest(dataclasses.replace(token(rng, 2), seconds=0.100, transfer=dropped))
    sentence = state.placement.sentence()
    assert sentence.startswith("60% of this step (100 ms) read 290 MB of the 297 MB placed on")
    assert "predicted 58 ms" in sentence and "reading the file bounds it" in sentence


def test_the_strip_says_what_a_step_reads():
    from ui.panels.placement import _moves

    assert _moves(PLACED) == "each step reads in 297 MB"
    assert "page cache lacks" in _moves(replace(PLACED, mapped=True))
    assert _moves(replace(PLACED, moved_bytes=0)) == "each step reads in nothing"


def test_an_unplaced_model_says_why_nothing_moves():
    state = InternalsState()
    state.set_model(model_info(precision="fast"))
    assert "compute from the mapped file instead" in state.placement.sentence()
    state.set_model(model_info())
    assert "nothing moves per token" in state.placement.sentence()


def test_panel_draws_the_strip_and_the_steps_from_the_timer(view, rng, qtbot):
    panel = view.placement
    view.redraw(force=True)
    assert panel.pages.empty  # a model wholly in place: the message says how to place one
    assert "nothing moves per token" in panel.pages.message.text()
    view.set_model(model_info(placement=PLACED))
    view.ingest(prefill(rng))
    for index in range(1, 6):
        view.ingest(moved(token(rng, index), step_s=0.12, transfer_s=0.06))
    view.docks["placement"].show()
    view.redraw(force=True)
    assert not panel.pages.empty
    assert panel.chart.placement == PLACED and len(panel.chart.steps) == 5
    assert panel.sentence.text().startswith("50% of this step (120 ms) moved 610 MB")
    assert not panel.needs_redraw()
    image = panel.chart.grab().toImage()
    # the strip's first cell is RAM (blue), its last disk (orange)
    y = panel.chart.fontMetrics().height() + 10
    assert image.pixelColor(10, y).blue() > 200
    assert image.pixelColor(panel.chart.width() - 10, y).red() > 200


def test_two_gpus_are_two_greens_and_nothing_moves(view, qtbot):
    split = Placement(
        layer_places=("cuda:0",) * 15 + ("cuda:1",) * 15,
        layer_bytes=(13 * MB,) * 30,
        place_bytes=(("cuda:0", 250 * MB), ("cuda:1", 288 * MB)),
        moved_bytes=0,
        read_bytes_per_s=0.0,
        execution_device="cuda:0",
    )
    view.set_model(model_info(placement=split))
    view.docks["placement"].show()
    view.redraw(force=True)
    sentence = view.placement.sentence.text()
    assert sentence.startswith("Every weight stays where it was placed (cuda:0, cuda:1)")
    chart = view.placement.chart
    image = chart.grab().toImage()
    y = chart.fontMetrics().height() + 10
    first, last = image.pixelColor(10, y), image.pixelColor(chart.width() - 10, y)
    assert first.green() > first.red() and last.green() > last.red()  # both green
    assert last.green() < first.green()  # the second GPU darker
    assert (place_name("cuda:1"), place_name("cpu")) == ("GPU 1", "RAM")


def test_the_roofline_puts_a_placed_step_under_its_read_roof(view, rng):
    view.set_model(model_info(placement=PLACED, peaks=PEAKS))  # placed: reads at 5 GB/s
    show(view, "roofline")
    view.ingest(replace(prefill(rng), roofline=roofline(9_000_000, 300_000, 0.001)))
    view.ingest(token(rng, 0))
    counted = roofline(600_000_000, 540 * MB, 0.100)  # a 100 ms step of 0.6 GFLOP
    step = moved(token(rng, 1), step_s=0.100, transfer_s=0.06, bytes_=297 * MB)
    view.ingest(replace(step, roofline=counted))
    view.redraw(force=True)
    panel = view.roofline
    # the step against the 297 MB it read in, exactly as the events say
    np.testing.assert_allclose(panel.read_points.xData, [600_000_000 / (297 * MB)])
    np.testing.assert_allclose(panel.read_points.yData, [counted.flops_per_s])
    np.testing.assert_allclose(panel.decode_points.xData, [counted.intensity])
    x, y = panel.read_line.getData()
    np.testing.assert_allclose(10.0**y / 10.0**x, 5e9)  # the roof: the measured read rate
    assert panel.read_key.isVisibleTo(panel)
    sentence = "at 2.97 GB/s, 59% of the 5 GB/s read bandwidth measured at load: under the"
    assert sentence in panel.phases.text()
    view.set_model(model_info(peaks=PEAKS))  # in memory: no read roof, no read points
    view.ingest(replace(prefill(rng), roofline=roofline(9_000_000, 300_000, 0.001)))
    view.redraw(force=True)
    assert panel.read_line.getData()[0] is None or not len(panel.read_line.getData()[0])
    assert not panel.read_key.isVisibleTo(panel) and not len(panel.read_points.xData)


def test_picker_carries_a_placement(qtbot):
    picker = ModelPicker(LoadRequest(device_map="gpu-layers=12", max_memory="cpu=250MiB"))
    qtbot.addWidget(picker)
    request = picker.request()
    assert (request.device_map, request.max_memory) == ("gpu-layers=12", "cpu=250MiB")
    picker.set_placement("auto", "")
    assert (picker.request().device_map, picker.request().max_memory) == ("auto", "")
    picker.set_placement("", "")
    assert not picker.request().placed
    picker._ram_cap.setText("lots")
    problem = picker.problem()
    assert problem is not None and "not a size: 'lots'" in problem


def test_the_status_line_says_where_a_placed_model_is():
    from ui.main_window import model_line

    assert "placed" not in model_line(model_info())
    assert model_line(model_info(placement=PLACED)).endswith("placed: 240 MB cpu, 297 MB disk")
