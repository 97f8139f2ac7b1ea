"""KV-cache panel: how many bytes the cache holds per token, measured and by the formula."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QComboBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QVBoxLayout,
    QWidget,
)

from engine.events import ModelInfo
from engine.kv_formula import formula_bytes, mha_bytes, sliding_tokens
from ui.panels.empty import EmptyState
from ui.panels.line_chart import LineChart, Series
from ui.panels.ranges import AxisLimit, decimate
from ui.panels.readout import ReadoutBox
from ui.panels.redraw import StatePanel
from ui.panels.state import KV, InternalsState
from ui.panels.state.explain import kv_line
from ui.panels.step_line import StepLine

TOTAL = "all layers (total)"
STACKED = "stacked by layer"
BYTE_UNITS = ((1.0, "B"), (2.0**10, "KiB"), (2.0**20, "MiB"), (2.0**30, "GiB"))
MATCH_TOLERANCE = 0.01  # the measured size may include a little bookkeeping

EMPTY_MESSAGE = (
    "<b>KV cache</b><br>Every token the model reads or writes leaves its keys and values in "
    "each layer's cache, so later tokens look them up instead of recomputing them. The curve "
    "will show the cache growing token by token, measured from the real tensors, beside the "
    "formula on the right.<br><br><i>Send a message to watch it grow.</i>"
)


def human_bytes(count: float) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"


def set_bar(bar: QProgressBar, value: int, maximum: int) -> None:
    """Move a progress bar without painting it there and then: QProgressBar.setValue
    repaints at once whenever the bar moves a pixel, costly in a floating dock.
    Enabling updates again schedules one ordinary paint with the next."""
    if (bar.value(), bar.maximum()) == (value, maximum):
        return
    bar.setUpdatesEnabled(False)
    bar.setRange(0, maximum)
    bar.setValue(value)
    bar.setUpdatesEnabled(True)


def formula_text(info: ModelInfo, tokens: int, measured: int | None) -> str:
    """The KV-cache formula filled in with the model's numbers, plain text with line breaks."""
    total = formula_bytes(info, tokens)
    head = (
        f"2 (K and V) × {info.kv_heads} KV heads × {info.head_dim} dims × "
        f"{info.bytes_per_value} bytes"
    )
    sliding = len(info.sliding_layers) if info.sliding_window else 0
    if sliding and info.sliding_window:
        full = info.layers - sliding
        window = sliding_tokens(info, tokens)
        lines = [
            f"{head} × ({full} full layers × {tokens:,} tokens + {sliding} sliding layers × "
            f"{window:,} tokens)",
            f"= {total:,} bytes ({human_bytes(total)})",
            f"Sliding-window layers keep only the last {info.sliding_window - 1:,} tokens"
            " (the window less the next query's own), so the formula caps them there.",
        ]
    else:
        lines = [
            f"2 (K and V) × {info.layers} layers × {info.kv_heads} KV heads × {info.head_dim} dims"
            f" × {tokens:,} tokens × {info.bytes_per_value} bytes",
            f"= {total:,} bytes ({human_bytes(total)})",
        ]
    lines.append(_measured_line(total, measured))
    lines.extend(sharing_lines(info, tokens))
    return "\n".join(lines)


def layer_formula_text(
    info: ModelInfo, layer: int, tokens: int, measured: int | None, whole: int | None
) -> str:
    """One layer's cache (the view of one layer): its formula, what its own tensors hold, and
    the whole cache's measured size for scale."""
    sliding = info.sliding_window is not None and layer in info.sliding_layers
    held = sliding_tokens(info, tokens) if sliding else tokens
    expected = 2 * info.kv_heads * info.head_dim * held * info.bytes_per_value
    kind = f" (sliding: at most the last {held:,} tokens)" if sliding else ""
    lines = [
        f"Layer {layer}{kind}: 2 (K and V) × {info.kv_heads} KV heads × {info.head_dim} dims ×"
        f" {held:,} tokens × {info.bytes_per_value} bytes",
        f"= {expected:,} bytes ({human_bytes(expected)})",
        _measured_line(expected, measured),
    ]
    if whole is not None:
        lines.append(f"All {info.layers} layers: {whole:,} bytes ({human_bytes(whole)}).")
    return "\n".join(lines)


def _measured_line(expected: int, measured: int | None) -> str:
    if measured is None:
        return "Measured: nothing yet."
    if expected == measured or (
        expected and abs(measured - expected) / expected <= MATCH_TOLERANCE
    ):
        return f"Measured: {measured:,} bytes ({human_bytes(measured)}) — matches the formula."
    return (
        f"Measured: {measured:,} bytes ({human_bytes(measured)}) — differs from the formula by "
        f"{measured - expected:+,} bytes."
    )


def sharing_lines(info: ModelInfo, tokens: int) -> list[str]:
    """The same cache with one K/V head per query head (MHA), this model's, and one K/V head
    for all (MQA): what sharing K/V heads between query heads saves."""
    count = tokens or info.max_context  # before a reply: what a full context would take
    where = f"{count:,} tokens" if tokens else f"a full {count:,}-token context"
    total = formula_bytes(info, count)
    mha = mha_bytes(info, count)
    mqa = formula_bytes(replace(info, kv_heads=1), count)
    heads, kv_heads = info.heads, info.kv_heads
    lines = [f"The cache for {where}, by how many K/V heads the {heads} query heads share:"]
    lines.append(
        f"• multi-head attention, {heads} K/V heads: {human_bytes(mha)}"
        + (" (this model)" if kv_heads >= heads else "")
    )
    saving = f"{human_bytes(mha - total)} ({heads}/{kv_heads} = {heads / kv_heads:g}x)"
    if 1 < kv_heads < heads:
        lines.append(
            f"• grouped-query attention, {kv_heads} K/V heads: {human_bytes(total)} (this "
            f"model): grouped-query attention saves {saving}"
        )
    mqa_line = f"• multi-query attention, 1 K/V head: {human_bytes(mqa)}"
    if kv_heads == 1 and heads > 1:
        mqa_line += f" (this model): multi-query attention saves {saving}"
    lines.append(mqa_line)
    return lines


class KvCachePanel(StatePanel):
    """Cache bytes against context length, per layer or in total, beside the formula."""

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, KV, parent)
        self.view_choice = QComboBox()
        self.view_choice.addItems([TOTAL, STACKED])
        self.view_choice.currentIndexChanged.connect(lambda _index: self.tracker.mark())
        # Painted (ui.panels.line_chart): as a pyqtgraph plot its one curve's update cost every
        # frame a repaint of the plot's scene.
        self.plot_widget = LineChart("KV cache size", "tokens in the cache", "cache", BYTE_UNITS)
        self._x_limit, self._y_limit = AxisLimit(), AxisLimit()  # see _set_range
        # Straight between its points: the cache's bytes are proportional to its tokens, and the
        # prompt, written in one pass, goes from the cache it started from to its end in one
        # line (as steps it drew an empty cache up to the prompt's last token, then a jump).
        self.curve = self.plot_widget.add_series(Series((66, 133, 244), width=1))
        self.stack_curves: list[Series] = []
        # The model the layer curves were made for: a new chat clears the data, not the model,
        # and making 30 curves again made its first frame a long one.
        self._built_for: ModelInfo | None = None
        self.formula = QLabel("Load a model to see the KV-cache formula.")
        self.formula.setWordWrap(True)
        self.formula.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.context = QProgressBar()
        self.context.setFormat("context: %v / %m tokens (%p%)")
        self.context.setRange(0, 1)
        self.context.setValue(0)
        self._build_layout()

    def _build_layout(self) -> None:
        controls = QHBoxLayout()
        controls.addWidget(QLabel("Show:"))
        controls.addWidget(self.view_choice, 1)
        chart = QWidget()
        left = QVBoxLayout(chart)
        left.setContentsMargins(0, 0, 0, 0)
        left.addLayout(controls)
        left.addWidget(self.plot_widget, 1)
        self.pages = EmptyState(EMPTY_MESSAGE, chart)
        right = QVBoxLayout()
        self.step_line = StepLine()
        right.addWidget(self.step_line)
        right.addWidget(ReadoutBox(self.formula))
        right.addWidget(self.context)
        right.addStretch(1)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.pages, 3)
        layout.addLayout(right, 2)

    # -- public ----------------------------------------------------------------------------

    def select_view(self, text: str) -> None:
        """Pick TOTAL, STACKED or "layer N"."""
        self._sync_choices()
        index = self.view_choice.findText(text)
        if index < 0:
            raise ValueError(f"no such KV view: {text!r}")
        self.view_choice.setCurrentIndex(index)

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        if self._state.info is not self._built_for:
            self._rebuild_for_model()
        self.pages.show_content(len(self._state.kv_tokens) > 0)
        self._draw_curves()
        self._draw_text()
        self._draw_selected_step()
        self.tracker.drawn(revisions)

    def _draw_selected_step(self) -> None:
        state = self._state
        self.step_line.say(kv_line(state), state.showing_step)
        position = state.selected_position
        # The cache held `position` tokens when the token at `position` was made.
        marked = state.showing_step and position is not None
        self.plot_widget.set_marker(float(position) if marked and position else None)

    # -- drawing ---------------------------------------------------------------------------

    def _sync_choices(self) -> None:
        info = self._state.info
        layers = info.layers if info is not None else 0
        if self.view_choice.count() != layers + 2:
            current = self.view_choice.currentText()
            self.view_choice.blockSignals(True)
            self.view_choice.clear()
            self.view_choice.addItems([TOTAL, STACKED, *(f"layer {i}" for i in range(layers))])
            self.view_choice.setCurrentIndex(max(self.view_choice.findText(current), 0))
            self.view_choice.blockSignals(False)

    def _rebuild_for_model(self) -> None:
        self._sync_choices()
        info = self._built_for = self._state.info
        layers = info.layers if info is not None else 0
        chart = self.plot_widget
        chart.series = [self.curve]
        colours = pg.colormap.get("viridis").getLookupTable(nPts=max(layers, 2))
        # Drawn from the top of the stack down (the chart draws its first series last, on
        # top), so each band fills over the ones above it.
        self.stack_curves = []
        for layer in range(layers):
            red, green, blue = (int(c) for c in colours[layer][:3])
            curve = Series((red, green, blue), width=1, fill=(red, green, blue, 150))
            curve.setVisible(False)
            self.stack_curves.append(chart.add_series(curve))

    def _draw_curves(self) -> None:
        state = self._state
        tokens = state.kv_tokens.view().astype(np.float64)
        choice = self.view_choice.currentText()
        per_layer = state.kv_layers.view() if state.kv_layers is not None else None
        stacked = choice == STACKED and per_layer is not None
        for curve in self.stack_curves:
            curve.setVisible(stacked)
        self.curve.setVisible(not stacked)
        if stacked and per_layer is not None:
            cumulative = np.cumsum(per_layer, axis=1, dtype=np.float64)
            for layer, curve in enumerate(self.stack_curves[: cumulative.shape[1]]):
                curve.setData(*self._fit(tokens, cumulative[:, layer]))
            values = cumulative[:, -1] if cumulative.size else np.zeros(0)
        elif (shown := self._shown_layer()) is not None:
            fits = per_layer is not None and shown < per_layer.shape[1]
            values = (
                per_layer[:, shown].astype(np.float64)
                if fits and per_layer is not None
                else np.zeros(0)
            )
            self.curve.setData(*self._fit(tokens[: len(values)], values))
        else:
            values = state.kv_bytes.view().astype(np.float64)
            self.curve.setData(*self._fit(tokens, values))
        self._set_range(float(tokens[-1]) if len(tokens) else 0.0, values)

    def _shown_layer(self) -> int | None:
        """The layer the view shows alone (None: all of them, total or stacked)."""
        choice = self.view_choice.currentText()
        return int(choice.split()[1]) if choice.startswith("layer ") else None

    def _fit(self, tokens: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # The cache only grows or holds: every k-th point of its steps loses nothing visible.
        pixels = self.plot_widget.plot_rect().width()
        return decimate(tokens, values, pixels, peak=False)

    def _set_range(self, last_token: float, values: np.ndarray) -> None:
        """Leave room to grow: the range changes a few times per reply, not every token."""
        self._x_limit.update(last_token)
        self._y_limit.update(float(values.max()) if values.size else 0.0)
        self.plot_widget.set_range(self._x_limit.limit, self._y_limit.limit)

    def _draw_text(self) -> None:
        state = self._state
        info = state.info
        tokens = state.cache_tokens
        if info is None:
            self.formula.setText("Load a model to see the KV-cache formula.")
            return
        measured = int(state.kv_bytes.last()) if len(state.kv_bytes) else None
        layer = self._shown_layer()
        if layer is None:
            self.formula.setText(formula_text(info, tokens, measured))
        else:  # the layer the curve shows, from its own tensors' bytes
            per_layer = state.kv_layers.view() if state.kv_layers is not None else None
            held = per_layer is not None and len(per_layer) and layer < per_layer.shape[1]
            own = int(per_layer[-1, layer]) if held and per_layer is not None else None
            self.formula.setText(layer_formula_text(info, layer, tokens, own, measured))
        set_bar(self.context, min(tokens, max(info.max_context, 1)), max(info.max_context, 1))
