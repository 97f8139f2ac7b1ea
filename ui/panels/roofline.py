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
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from engine.events import Peaks, Roofline, Transfer
from ui.panels.empty import EmptyState, column
from ui.panels.key import key_label
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import StatePanel, Throttle
from ui.panels.state import ROOFLINE, InternalsState
from ui.panels.state.explain import roofline_line
from ui.panels.step_line import StepLine

# The decode cloud keeps the latest steps: one symbol each, so a frame's cost stays bounded.
DECODE_POINTS = 512
# A new step moves the cloud by a hair: redraw it at most this often (a scatter's setData and
# its repaint are a costly part of a frame); a new reply, a cleared chat or new peaks redraw on the
# next frame.
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


def si(value: float, unit: str) -> str:
    """1.23e12, "FLOP/s" -> "1.23 TFLOP/s"."""
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


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


def decade_ticks(low: int, high: int, unit: str) -> list[tuple[float, str]]:
    """(log10 position, label) for each power of ten from 10**low to 10**high."""
    return [(float(power), si(10.0**power, unit).strip()) for power in range(low, high + 1)]


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


class LogPoints(pg.ScatterPlotItem):  # type: ignore[misc]  # pyqtgraph is untyped
    """Points of the log-log chart, styled once: given in data units (kept as `xData` and
    `yData`, as a PlotDataItem keeps them), drawn at their base-10 logarithms.

    As a PlotDataItem, each new set of points passed the symbol's brush and pen again;
    pyqtgraph copies them, and a new brush object is a new entry in the item's symbol atlas:
    the symbol was rendered and the atlas packed again at every redraw of the cloud, most of
    its cost. Points that a log axis cannot place (zero or less) are not drawn.
    """

    def __init__(self, **style: object) -> None:
        super().__init__(pxMode=True, **style)
        self.xData = np.zeros(0)
        self.yData = np.zeros(0)

    def set_points(self, x: np.ndarray, y: np.ndarray) -> None:
        x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
        self.xData, self.yData = x, y
        drawn = (x > 0) & (y > 0)
        self.setData(x=np.log10(x[drawn]), y=np.log10(y[drawn]))


class RooflinePanel(StatePanel):
    """The roofline chart, one sentence per phase and how the peaks were measured."""

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, ROOFLINE, parent)
        self._range: tuple[tuple[int, int], tuple[int, int]] | None = None
        self._roof_key: tuple[object, ...] = ()
        self._prefills_drawn: tuple[object, ...] = ()
        self._cloud_throttle = Throttle()
        self.plot_widget = pg.PlotWidget(title="Roofline")
        plot = self.plot_widget.getPlotItem()
        plot.setLogMode(x=True, y=True)
        plot.setLabel("bottom", "arithmetic intensity (FLOP per byte moved)")
        plot.setLabel("left", "achieved FLOP/s")
        for side in ("left", "bottom"):
            plot.getAxis(side).enableAutoSIPrefix(False)
        plot.showGrid(x=True, y=True, alpha=0.2)
        plot.setMouseEnabled(x=False, y=False)
        plot.setMenuEnabled(False)
        plot.disableAutoRange()
        self.bandwidth_line = pg.PlotDataItem(pen=pg.mkPen(BANDWIDTH_PEN, width=2))
        self.compute_line = pg.PlotDataItem(pen=pg.mkPen(COMPUTE_PEN, width=2))
        self.decode_points = LogPoints(symbol="o", size=5, pen=None, brush=DECODE_BRUSH)
        self.latest_decode = LogPoints(symbol="o", size=11, pen="w", brush=LATEST_DECODE_BRUSH)
        self.prefill_points = LogPoints(symbol="d", size=13, pen="w", brush=PREFILL_BRUSH)
        read_pen = pg.mkPen(READ_PEN, width=2, style=Qt.PenStyle.DashLine)
        self.read_line = pg.PlotDataItem(pen=read_pen)
        self.read_points = LogPoints(symbol="t", size=8, pen=None, brush=READ_BRUSH)
        for item in (
            self.bandwidth_line, self.compute_line, self.read_line, self.prefill_points,
            self.read_points,
        ):  # fmt: skip
            plot.addItem(item)
        self.selected_point = LogPoints(symbol="s", size=15, pen="w", brush=SELECTED_BRUSH)
        plot.addItem(self.decode_points)
        plot.addItem(self.latest_decode)
        plot.addItem(self.selected_point)
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
        chart = column([self.key, self.read_key, self.plot_widget], grows=self.plot_widget)
        self.phases = QLabel("")
        self.phases.setTextFormat(Qt.TextFormat.RichText)
        self.phases.setWordWrap(True)
        self.peaks = QLabel(peaks_sentence(None))
        self.peaks.setWordWrap(True)
        self.pages = EmptyState(EMPTY_MESSAGE, chart)
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
        self._set_range(decade_range(xs), decade_range(ys))

    def _set_range(self, x: tuple[int, int], y: tuple[int, int]) -> None:
        """Whole decades, changed only when a point leaves them (not every frame)."""
        if (x, y) == self._range:
            return
        self._range = (x, y)
        plot = self.plot_widget.getPlotItem()
        plot.setRange(xRange=x, yRange=y, padding=0)
        # One labelled tick per decade (pyqtgraph's log ticks crowd 2·10¹ 3·10¹ … together).
        plot.getAxis("bottom").setTicks([decade_ticks(*x, "")])
        plot.getAxis("left").setTicks([decade_ticks(*y, "")])

    def _draw_roof(self) -> None:
        peaks, read = self._state.peaks, self._read_bandwidth()
        key = (peaks, self._range, read)
        if key == self._roof_key:
            return
        self._roof_key = key
        self.read_key.setVisible(read > 0)
        if peaks is None or self._range is None:
            for line in (self.bandwidth_line, self.compute_line, self.read_line):
                line.setData([], [])
            return
        (x_low, x_high), _y = self._range
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
