"""Attention panel: one heatmap per head that grows a row per generated token."""

from __future__ import annotations

import math

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, QRectF, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from ui.panels.buffers import ATTENTION, AttentionRows, InternalsState, RedrawTracker

# Bounded work per frame: rows and keys past these are max-pooled into one image cell.
DISPLAY_ROWS = 256
DISPLAY_KEYS = 512
POOL_CHUNK = 32  # rows pooled per dense copy when the whole view is pooled again
ALL_HEADS = "all heads"
MEASURES = {"mean max weight": "max", "mean entropy (normalized)": "entropy"}


def colour_table() -> np.ndarray:
    return pg.colormap.get("viridis").getLookupTable(nPts=256)


def max_pool_keys(block: np.ndarray, factor: int) -> np.ndarray:
    """Max over each run of `factor` keys of [heads, rows, columns * factor]."""
    out = block[:, :, 0::factor].copy()
    for offset in range(1, factor):
        np.maximum(out, block[:, :, offset::factor], out=out)
    return out


class PooledRows:
    """A display copy of one layer's rows, max-pooled to at most DISPLAY_ROWS x DISPLAY_KEYS.

    Rows only ever change at the bottom (a new row, or the last one rewritten), so each frame
    pools just the rows since the last pooled block; rows dropped from the top shift the pooled
    blocks up. A new reply or new pooling factors start it over, pooling POOL_CHUNK rows at a
    time so a long context never needs a dense copy of every row. Max-pooling keeps a lone
    strong weight visible however far it zooms out.
    """

    def __init__(self) -> None:
        self._key: tuple = ()
        self._data = np.zeros((0, 0, 0), dtype=np.float32)
        self._rows = 0
        self._dropped = 0

    def update(self, rows: AttentionRows) -> tuple[np.ndarray, int, int]:
        """The pooled [heads, row blocks, key blocks] and how many rows and keys a cell covers."""
        row_factor = max(math.ceil(rows.rows / DISPLAY_ROWS), 1)
        key_factor = max(math.ceil(rows.keys / DISPLAY_KEYS), 1)
        key = (rows.serial, rows.heads, row_factor, key_factor)
        shift = rows.dropped - self._dropped
        if key != self._key or shift % row_factor or not 0 <= shift <= self._rows:
            self._key, self._rows = key, 0
            self._data = np.zeros((rows.heads, DISPLAY_ROWS, DISPLAY_KEYS), dtype=np.float32)
        elif shift:
            self._shift(shift // row_factor)
            self._rows -= shift
        self._dropped = rows.dropped
        self._rows = min(self._rows, rows.rows)
        columns = math.ceil(rows.keys / key_factor)
        blocks = math.ceil(rows.rows / row_factor)
        chunk = row_factor * max(POOL_CHUNK // row_factor, 1)
        first = max(self._rows - 1, 0) // row_factor  # the block holding the last row seen
        for start in range(first * row_factor, rows.rows, chunk):
            source = rows.padded(start, columns * key_factor, start + chunk)
            pooled = max_pool_keys(source, key_factor)
            starts = np.arange(0, pooled.shape[1], row_factor)
            block = start // row_factor
            self._data[:, block : block + starts.size, :columns] = np.maximum.reduceat(
                pooled, starts, axis=1
            )
        self._rows = rows.rows
        return self._data[:, :blocks, :columns], row_factor, key_factor

    def _shift(self, blocks: int) -> None:
        kept = self._data.shape[1] - blocks
        self._data[:, :kept] = self._data[:, blocks:].copy()
        self._data[:, kept:] = 0.0


def head_level(values: np.ndarray, quantile: float = 0.99) -> float:
    """The top colour level for one head: a high quantile of its nonzero weights.

    Not the max: the first query can only attend to itself (weight 1), which would leave
    everything else dark. A strided sample keeps the cost bounded.
    """
    sample = values.ravel()[:: max(values.size // 20_000, 1)]
    sample = sample[sample > 0]
    top = float(np.quantile(sample, quantile)) if sample.size else 1.0
    return top if top > 0 else 1.0


def display_token(text: str) -> str:
    return repr(text)[1:-1] if text.strip() else repr(text)


class AttentionPanel(QWidget):
    """Per-head causal attention of a watched layer, plus a layer x head overview."""

    # The layers the app should capture from the next reply on (the watched ones plus a pick).
    watched_layers_requested = Signal(tuple)

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._state = state
        self.tracker = RedrawTracker(state, ATTENTION)
        self._lut = colour_table()
        self._layout_key: tuple = ()
        self._pooled = PooledRows()
        self._overview_title = ""
        self._choices_key: tuple = ()
        self.head_plots: dict[int, pg.PlotItem] = {}
        self.head_images: dict[int, pg.ImageItem] = {}
        self.overview_layers: tuple[int, ...] = ()
        self._build_controls()
        self.grid = pg.GraphicsLayoutWidget()
        self.grid.scene().sigMouseMoved.connect(self._on_hover)
        self.hover = QLabel("Hover a heatmap to read a weight.")
        self._build_overview()
        grid_box = QWidget()
        grid_layout = QVBoxLayout(grid_box)
        grid_layout.setContentsMargins(0, 0, 0, 0)
        grid_layout.addWidget(self.grid, 1)
        grid_layout.addWidget(self.hover)
        overview_box = QWidget()
        overview_layout = QVBoxLayout(overview_box)
        overview_layout.setContentsMargins(0, 0, 0, 0)
        overview_layout.addWidget(self.measure_choice)
        overview_layout.addWidget(self.overview, 1)
        splitter = QSplitter()
        splitter.addWidget(grid_box)
        splitter.addWidget(overview_box)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(self._controls)
        layout.addWidget(splitter, 1)

    # -- construction ------------------------------------------------------------------------

    def _build_controls(self) -> None:
        self.layer_choice = QComboBox()
        self.layer_choice.activated.connect(self._on_layer_picked)
        self.head_choice = QComboBox()
        self.head_choice.addItem(ALL_HEADS)
        self.head_choice.currentIndexChanged.connect(lambda _index: self.tracker.mark())
        self.per_head_scale = QCheckBox("scale each head")
        self.per_head_scale.setToolTip(
            "Spread the colours over each head's own weights (up to their 99th percentile) "
            "instead of 0 to 1: most weights are small beside a few sinks."
        )
        self.per_head_scale.setChecked(True)
        self.per_head_scale.toggled.connect(lambda _on: self.tracker.mark())
        self.measure_choice = QComboBox()
        self.measure_choice.addItems(list(MEASURES))
        self.measure_choice.currentIndexChanged.connect(lambda _index: self.tracker.mark())
        self._controls = QHBoxLayout()
        for label, widget in (("Layer:", self.layer_choice), ("Head:", self.head_choice)):
            self._controls.addWidget(QLabel(label))
            self._controls.addWidget(widget)
        self._controls.addWidget(self.per_head_scale)
        self._controls.addStretch(1)

    def _build_overview(self) -> None:
        self.overview = pg.PlotWidget(title="Layer × head")
        plot = self.overview.getPlotItem()
        plot.setLabel("bottom", "head")
        plot.setLabel("left", "layer")
        plot.invertY(True)
        plot.setMouseEnabled(x=False, y=False)
        self.overview_image = pg.ImageItem(axisOrder="row-major")
        self.overview_image.setLookupTable(self._lut)
        plot.addItem(self.overview_image)
        self.overview.scene().sigMouseClicked.connect(self._on_overview_click)

    # -- public ----------------------------------------------------------------------------

    @property
    def selected_layer(self) -> int | None:
        data = self.layer_choice.currentData()
        return None if data is None else int(data)

    @property
    def selected_head(self) -> int | None:
        data = self.head_choice.currentData()
        return None if data is None else int(data)

    def select(self, layer: int, head: int | None = None) -> None:
        """Show `layer` (asking for it to be watched if it is not) and one head or all."""
        self._sync_choices()
        index = self.layer_choice.findData(layer)
        if index >= 0:
            self.layer_choice.setCurrentIndex(index)
            self._on_layer_picked(index)
        head_index = 0 if head is None else self.head_choice.findData(head)
        if head_index >= 0:
            self.head_choice.setCurrentIndex(head_index)
        self.tracker.mark()

    def describe(self, head: int, row: int, key: int) -> str:
        """What the hover line says about one cell (row: index into the layer's buffer)."""
        layer = self.selected_layer
        rows = self._state.attention.get(layer) if layer is not None else None
        if rows is None or not 0 <= row < rows.rows or not 0 <= key < rows.keys:
            return ""
        query = int(rows.positions[row])
        if key > query:
            return f"head {head} · query #{query} cannot see key #{key} (causal mask)"
        state = self._state
        return (
            f"head {head} · query #{query} '{display_token(state.token_text(query))}' → "
            f"key #{key} '{display_token(state.token_text(key))}': "
            f"{rows.value(row, key, head):.4f}"
        )

    def needs_redraw(self) -> bool:
        return self.tracker.stale

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        self._sync_choices()
        self._draw_heads()
        self._draw_overview()
        self.tracker.drawn(revisions)

    # -- choices ---------------------------------------------------------------------------

    def _sync_choices(self) -> None:
        state = self._state
        layers = state.info.layers if state.info is not None else 0
        heads = state.info.heads if state.info is not None else 0
        recorded = tuple(sorted(state.attention))
        key = (layers, heads, state.watched_layers, recorded)
        if key == self._choices_key:
            return
        self._choices_key = key
        current = self.selected_layer
        self.layer_choice.blockSignals(True)
        self.layer_choice.clear()
        for layer in sorted(set(range(layers)) | set(recorded) | set(state.watched_layers)):
            watched = layer in state.watched_layers or layer in recorded
            suffix = "" if watched else " (watch from the next reply)"
            self.layer_choice.addItem(f"layer {layer}{suffix}", layer)
        default = current if current is not None else (state.watched_layers or recorded or (0,))[0]
        self.layer_choice.setCurrentIndex(max(self.layer_choice.findData(default), 0))
        self.layer_choice.blockSignals(False)
        head = self.selected_head
        self.head_choice.blockSignals(True)
        self.head_choice.clear()
        self.head_choice.addItem(ALL_HEADS)
        for index in range(heads):
            self.head_choice.addItem(f"head {index}", index)
        self.head_choice.setCurrentIndex(max(self.head_choice.findData(head), 0))
        self.head_choice.blockSignals(False)

    def _on_layer_picked(self, _index: int) -> None:
        layer = self.selected_layer
        watched = self._state.watched_layers
        if layer is not None and layer not in watched:
            self.watched_layers_requested.emit(tuple(sorted({*watched, layer})))
        self.tracker.mark()

    # -- heatmaps --------------------------------------------------------------------------

    def _heads_to_show(self, heads: int) -> list[int]:
        head = self.selected_head
        return [head] if head is not None and head < heads else list(range(heads))

    def _rebuild_grid(self, shown: list[int]) -> None:
        self.grid.clear()
        self.head_plots.clear()
        self.head_images.clear()
        columns = max(math.ceil(math.sqrt(len(shown))), 1)
        for slot, head in enumerate(shown):
            plot = self.grid.addPlot(row=slot // columns, col=slot % columns, title=f"head {head}")
            plot.invertY(True)
            plot.hideAxis("bottom")
            plot.hideAxis("left")
            plot.setMenuEnabled(False)
            image = pg.ImageItem(axisOrder="row-major")
            image.setLookupTable(self._lut)
            plot.addItem(image)
            self.head_plots[head] = plot
            self.head_images[head] = image

    def _draw_heads(self) -> None:
        layer = self.selected_layer
        rows = self._state.attention.get(layer) if layer is not None else None
        heads = (
            rows.heads if rows is not None else (self._state.info.heads if self._state.info else 0)
        )
        shown = self._heads_to_show(heads)
        if (heads, tuple(shown)) != self._layout_key:
            self._rebuild_grid(shown)
            self._layout_key = (heads, tuple(shown))
        if rows is None or rows.rows == 0:
            for image in self.head_images.values():
                image.clear()
            if layer is not None and layer not in self._state.watched_layers:
                self.hover.setText(
                    f"Layer {layer} is not watched yet: it is recorded from the next reply."
                )
            return
        matrix, row_factor, key_factor = self._pooled.update(rows)
        # Image cells map back to buffer rows and keys, so hover reads the exact weight.
        rect = QRectF(0, 0, matrix.shape[2] * key_factor, matrix.shape[1] * row_factor)
        per_head = self.per_head_scale.isChecked()
        for head, image in self.head_images.items():
            values = np.ascontiguousarray(matrix[head])
            top = head_level(values) if per_head else 1.0
            image.setImage(values, levels=(0.0, top), autoLevels=False)
            image.setRect(rect)

    def _on_hover(self, position: QPointF) -> None:
        for head, plot in self.head_plots.items():
            if not plot.vb.sceneBoundingRect().contains(position):
                continue
            point = plot.vb.mapSceneToView(position)
            text = self.describe(head, math.floor(point.y()), math.floor(point.x()))
            if text:
                self.hover.setText(text)
            return

    # -- overview --------------------------------------------------------------------------

    def _draw_overview(self) -> None:
        stats = self._state.head_stats
        measure = MEASURES[self.measure_choice.currentText()]
        layers = tuple(sorted(stats))
        self.overview_layers = layers
        if not layers:
            self.overview_image.clear()
            return
        heads = max(s.heads for s in stats.values())
        grid = np.zeros((len(layers), heads), dtype=np.float32)
        for row, layer in enumerate(layers):
            values = stats[layer].mean(measure)
            grid[row, : values.size] = values
        low, high = float(grid.min()), float(grid.max())
        high = max(high, low + 1e-6)  # spread the colours over the values present
        self.overview_image.setImage(grid, levels=(low, high), autoLevels=False)
        title = f"{self.measure_choice.currentText()}: {low:.3g}–{high:.3g}"
        if title != self._overview_title:  # a new title re-lays the plot out
            self._overview_title = title
            self.overview.getPlotItem().setTitle(title)
        self.overview_image.setRect(QRectF(0, 0, heads, len(layers)))
        plot = self.overview.getPlotItem()
        plot.getAxis("left").setTicks([[(i + 0.5, str(layer)) for i, layer in enumerate(layers)]])
        plot.getAxis("bottom").setTicks([[(h + 0.5, str(h)) for h in range(heads)]])

    def overview_cell(self, scene_position: QPointF) -> tuple[int, int] | None:
        """The (layer, head) under a scene position of the overview, if any."""
        view = self.overview.getPlotItem().vb
        if not self.overview_layers or not view.sceneBoundingRect().contains(scene_position):
            return None
        point = view.mapSceneToView(scene_position)
        row, head = math.floor(point.y()), math.floor(point.x())
        if 0 <= row < len(self.overview_layers) and 0 <= head < self.overview_image.width():
            return self.overview_layers[row], head
        return None

    def _on_overview_click(self, event) -> None:
        cell = self.overview_cell(event.scenePos())
        if cell is not None:
            self.select(*cell)
