"""Roofline panel: why prefill and decode run at such different speeds.

Log-log, arithmetic intensity (FLOP per byte moved) against achieved FLOP/s. The roof is the
machine's measured peaks: a slope (bandwidth × intensity) up to the ridge point, then the
compute ceiling. Prefill multiplies many tokens by each weight it reads and lands right of
the ridge; decode reads every weight for one token and lands on the slope, far below the
ceiling. Every point and figure is an event's own `roofline` numbers.
"""

from __future__ import annotations

import html
import math

import numpy as np
from PySide6.QtCore import Qt
from PySide6.QtGui import QColor, QPen
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.events import Peaks, Roofline, Transfer
from ui.panels.empty import EmptyState, column
from ui.panels.key import key_label
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import StatePanel, Throttle
from ui.panels.roofline_chart import RooflineChart, si
from ui.panels.state import ROOFLINE, InternalsState
from ui.panels.state.explain import roofline_line
from ui.panels.step_line import StepLine

# The decode cloud keeps the latest steps: one symbol each, so a frame's cost stays bounded.
DECODE_POINTS = 512
# A new step moves the cloud by a hair: redraw it at most this often; a new reply, a cleared
# chat or new peaks redraw on the next frame.
CLOUD_INTERVAL_S = 1.0
PREFILL_BRUSH = (66, 133, 244)
DECODE_BRUSH = (52, 168, 83, 110)
LATEST_DECODE_BRUSH = (52, 168, 83)
SELECTED_BRUSH = (255, 200, 40)  # the selected step (ui.panels.line_chart.MARKER)
BANDWIDTH_PEN = (251, 188, 5)
COMPUTE_PEN = (217, 48, 37)
READ_PEN = (251, 140, 0)  # the Placement panel's orange: weights read in
READ_BRUSH = (251, 140, 0, 160)
MARGIN_DECADES = 0.4  # room around the points and the ridge, in powers of ten

EMPTY_MESSAGE = (
    "<b>Roofline</b><br>Where each phase of a reply sits against this machine's limits: "
    "FLOP per byte read (x) against FLOP per second achieved (y), under the measured "
    "memory-bandwidth slope and compute ceiling.<br>Prefill does many FLOPs for every "
    "weight it reads (compute-bound); decode reads all the weights for one token "
    "(memory-bound).<br><br><i>Send a message to place its prefill and decode steps.</i>"
)
NO_ROOFLINE_MESSAGE = (
    "<b>Roofline</b><br>This engine reports no FLOP and byte counts, so there is nothing to "
    "place on the roofline."
)


def phase_sentence(phase: str, roofline: Roofline, peaks: Peaks | None) -> str:
    """E.g. "decode: 1.9 FLOP/byte, 71% of measured bandwidth: memory-bound"."""
    head = f"{phase}: {roofline.intensity:.3g} FLOP/byte"
    achieved = f"{si(roofline.flops_per_s, 'FLOP/s')}, {si(roofline.bytes_per_s, 'B/s')}"
    bound = f"{roofline.bound}-bound"
    if peaks is None:
        return f"{head} ({achieved}): {bound}"
    if roofline.bound == "memory":
        share, limit = roofline.bytes_per_s / peaks.peak_bytes_per_s, "bandwidth"
    else:
        share, limit = roofline.flops_per_s / peaks.peak_flops_per_s, "compute"
    return f"{head}, {share:.0%} of measured {limit}: {bound} ({achieved})"


def peaks_sentence(peaks: Peaks | None) -> str:
    if peaks is None:
        return "Peaks not measured yet: the roof appears once the engine has measured them."
    ridge = peaks.peak_flops_per_s / peaks.peak_bytes_per_s
    return (
        f"Measured peaks ({peaks.dtype}): {si(peaks.peak_flops_per_s, 'FLOP/s')} compute, "
        f"{si(peaks.peak_bytes_per_s, 'B/s')} memory bandwidth; ridge at {ridge:.3g} "
        f"FLOP/byte. {peaks.method}"
    )


def decade_range(values: list[float]) -> tuple[int, int]:
    """Whole powers of ten around the positive `values`, with a margin (log10 units)."""
    logs = [math.log10(v) for v in values if v > 0 and math.isfinite(v)]
    if not logs:
        return (0, 1)
    return math.floor(min(logs) - MARGIN_DECADES), math.ceil(max(logs) + MARGIN_DECADES)


def set_text(label: QLabel, text: str) -> None:
    if text != label.text():  # a new text lays the readout out again
        label.setText(text)


def read_sentence(roofline: Roofline, transfer: Transfer, read_bytes_per_s: float) -> str:
    """A placed model's decode step against the weights it read in, e.g. "decode, against
    the 2.53 GB read in: 0.0012 FLOP/byte at 4.3 GB/s, 57% of the 7.5 GB/s read bandwidth
    measured at load: under the transfer roof"."""
    step_s = roofline.flops / roofline.flops_per_s if roofline.flops_per_s > 0 else 0.0
    rate = transfer.bytes / step_s if step_s > 0 else 0.0
    head = (
        f"decode, against the {si(transfer.bytes, 'B')} read in:"
        f" {roofline.flops / transfer.bytes:.3g} FLOP/byte at {si(rate, 'B/s')}"
    )
    if read_bytes_per_s <= 0:
        return head
    share = rate / read_bytes_per_s
    where = "under the transfer roof" if share <= 1 else "the reads went faster than at load"
    return (
        f"{head}, {share:.0%} of the {si(read_bytes_per_s, 'B/s')} read bandwidth measured"
        f" at load: {where}"
    )


class RooflinePanel(StatePanel):
    """The roofline chart, one sentence per phase and how the peaks were measured."""

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, ROOFLINE, parent)
        self._roof_key: tuple[object, ...] = ()
        self._prefills_drawn: tuple[object, ...] = ()
        self._cloud_throttle = Throttle()
        self.chart = RooflineChart(
            "Roofline", "arithmetic intensity (FLOP per byte moved)", "achieved FLOP/s"
        )
        chart = self.chart
        self.bandwidth_line = chart.add_line("memory roof", QPen(QColor(*BANDWIDTH_PEN), 2))
        self.compute_line = chart.add_line("compute ceiling", QPen(QColor(*COMPUTE_PEN), 2))
        read_pen = QPen(QColor(*READ_PEN), 2)
        read_pen.setStyle(Qt.PenStyle.DashLine)
        self.read_line = chart.add_line("read roof", read_pen)
        # The first added lowest: the selected step on top of everything.
        self.prefill_points = chart.add_points("prefill", "d", 13, PREFILL_BRUSH, outlined=True)
        self.read_points = chart.add_points(
            "decode step against the bytes read in", "t", 8, READ_BRUSH
        )
        self.decode_points = chart.add_points("decode step", "o", 5, DECODE_BRUSH)
        self.latest_decode = chart.add_points(
            "latest decode step", "o", 11, LATEST_DECODE_BRUSH, outlined=True
        )
        self.selected_point = chart.add_points(
            "selected step", "s", 15, SELECTED_BRUSH, outlined=True
        )
        # The key above the chart: a legend inside it covered the roof's upper left.
        self.key = key_label(
            [
                (BANDWIDTH_PEN, "memory bandwidth × intensity"),
                (COMPUTE_PEN, "compute ceiling"),
                (PREFILL_BRUSH, "prefill (each reply)"),
                (LATEST_DECODE_BRUSH, "decode steps (this reply)"),
            ]
        )
        # Only for a model whose steps read weights in (a placement): its lower roof.
        self.read_key = key_label(
            [
                (READ_PEN, "weights read in: read bandwidth × intensity (dashed)"),
                (READ_BRUSH, "decode steps against the bytes read in"),
            ]
        )
        self.read_key.hide()
        box = column([self.key, self.read_key, self.chart], grows=self.chart)
        self.phases = QLabel("")
        self.phases.setTextFormat(Qt.TextFormat.RichText)
        self.phases.setWordWrap(True)
        self.peaks = QLabel(peaks_sentence(None))
        self.peaks.setWordWrap(True)
        self.pages = EmptyState(EMPTY_MESSAGE, box)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        self.step_line = StepLine()
        layout.addWidget(self.step_line)
        layout.addWidget(self.pages, 1)
        layout.addWidget(ReadoutBox(self.phases))
        layout.addWidget(ReadoutBox(self.peaks))

    # -- public ----------------------------------------------------------------------------

    def needs_redraw(self) -> bool:
        due = self._state.explaining or self._cloud_throttle.due(CLOUD_INTERVAL_S, self._shape())
        return self.tracker.stale and due  # while a teacher steps, at once

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        state = self._state
        trace = state.roofline
        self._cloud_throttle.drawn(self._shape())
        set_text(self.peaks, peaks_sentence(state.peaks))
        set_text(self.phases, self._phases_html())
        if not state.replies:
            self.pages.set_message(EMPTY_MESSAGE)
        elif trace.empty:
            self.pages.set_message(NO_ROOFLINE_MESSAGE)
        self.pages.show_content(not trace.empty)
        if not trace.empty:
            self._draw_points()
            self._draw_roof()
        self._draw_selected_step()
        self.tracker.drawn(revisions)

    def _draw_selected_step(self) -> None:
        state = self._state
        self.step_line.say(roofline_line(state), state.showing_step)
        step = state.selected_step
        roofline = state.step_rooflines[step] if step is not None else None
        if state.showing_step and roofline is not None:
            self.selected_point.set_points(
                np.array([roofline.intensity]), np.array([roofline.flops_per_s])
            )
        else:
            self.selected_point.set_points(np.zeros(0), np.zeros(0))

    # -- drawing ---------------------------------------------------------------------------

    def _shape(self) -> tuple[object, ...]:
        """What, changed, redraws at once: the trace (a cleared chat), each reply, the peaks."""
        trace = self._state.roofline
        state = self._state
        selected = (state.selected, state.explaining)  # a teacher's click shows at once
        shape = (id(trace), len(trace.prefills), state.peaks, len(state.replies), selected)
        return (*shape, self._read_bandwidth())

    def _read_bandwidth(self) -> float:
        """The placement's measured read bandwidth; 0 for a model whose steps move nothing."""
        placement = self._state.placement.placement
        return placement.read_bytes_per_s if placement and placement.moved_bytes else 0.0

    def _phases_html(self) -> str:
        trace, peaks = self._state.roofline, self._state.peaks
        lines = []
        if trace.latest_prefill is not None:
            lines.append(phase_sentence("prefill", trace.latest_prefill, peaks))
        if trace.latest_decode is not None:
            lines.append(phase_sentence("decode", trace.latest_decode, peaks))
        if trace.latest_read is not None:
            lines.append(read_sentence(*trace.latest_read, self._read_bandwidth()))
        return "<br>".join(html.escape(line) for line in lines)

    def _draw_points(self) -> None:
        trace = self._state.roofline
        prefills = [roofline for _turn, roofline in trace.prefills]
        prefill_x = np.array([r.intensity for r in prefills], dtype=np.float64)
        prefill_y = np.array([r.flops_per_s for r in prefills], dtype=np.float64)
        if (id(trace), len(prefills)) != self._prefills_drawn:  # once a reply
            self._prefills_drawn = (id(trace), len(prefills))
            self.prefill_points.set_points(prefill_x, prefill_y)
        decode_x = trace.decode_intensity.view()[-DECODE_POINTS:]
        decode_y = trace.decode_flops_per_s.view()[-DECODE_POINTS:]
        self.decode_points.set_points(decode_x, decode_y)
        self.latest_decode.set_points(decode_x[-1:], decode_y[-1:])
        read_x = trace.read_intensity.view()[-DECODE_POINTS:]
        read_y = trace.read_flops_per_s.view()[-DECODE_POINTS:]
        self.read_points.set_points(read_x, read_y)
        xs, ys = [*prefill_x], [*prefill_y]
        for x, y in ((decode_x, decode_y), (read_x, read_y)):
            if x.size:
                xs += [x.min(), x.max()]
                ys += [y.min(), y.max()]
        peaks = self._state.peaks
        if peaks is not None:
            xs.append(peaks.peak_flops_per_s / peaks.peak_bytes_per_s)
            ys.append(peaks.peak_flops_per_s)
        # Whole decades: the chart moves only when a point leaves them (not every frame).
        self.chart.set_decades(decade_range(xs), decade_range(ys))

    def _draw_roof(self) -> None:
        peaks, read = self._state.peaks, self._read_bandwidth()
        decades = self.chart.decades  # set by _draw_points just before
        key = (peaks, decades, read)
        if key == self._roof_key:
            return
        self._roof_key = key
        self.read_key.setVisible(read > 0)
        if peaks is None:
            for line in (self.bandwidth_line, self.compute_line, self.read_line):
                line.setData([], [])
            return
        (x_low, x_high), _y = decades
        left, right = 10.0**x_low, 10.0**x_high
        ridge = peaks.peak_flops_per_s / peaks.peak_bytes_per_s
        self.bandwidth_line.setData(*slope(left, ridge, peaks.peak_bytes_per_s))
        self.compute_line.setData([ridge, right], [peaks.peak_flops_per_s] * 2)
        if read > 0:  # the lower roof a placed model's step meets: as far as the ceiling
            self.read_line.setData(*slope(left, peaks.peak_flops_per_s / read, read))
        else:
            self.read_line.setData([], [])


def slope(left: float, right: float, bytes_per_s: float) -> tuple[list[float], list[float]]:
    """A bandwidth roof from intensity `left` to `right`: FLOP/s = bandwidth × intensity."""
    return [left, right], [bytes_per_s * left, bytes_per_s * right]
