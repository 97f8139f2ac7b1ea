"""Attention panel: the heads of a layer as one mosaic that grows a row per generated token."""

from __future__ import annotations

import math

import numpy as np
from PySide6.QtCore import QPointF, QRectF, Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSplitter,
    QVBoxLayout,
    QWidget,
)

from ui.panels.attention_tiles import (
    FLATTEST_TILE,
    axis_token,
    colour_table,
    describe_cell,
    row_path,
    tile_aspect,
)
from ui.panels.empty import EmptyState
from ui.panels.head_overview import HeadOverview
from ui.panels.mosaic import (
    MOSAIC_LEVELS,
    MosaicLayout,
    best_columns,
    mosaic_colours,
)
from ui.panels.mosaic_view import MosaicView
from ui.panels.pooled_rows import DISPLAY_KEYS, DISPLAY_ROWS, PooledRows
from ui.panels.redraw import StatePanel
from ui.panels.state import ATTENTION, AttentionRows, InternalsState
from ui.panels.state.explain import attention_line, attention_query, position_of_query
from ui.panels.step_line import StepLine

# Within DISPLAY_ROWS x DISPLAY_KEYS (pooled_rows.py), a tile has about one cell per screen
# pixel: finer cells cost pooling, upload and painting, and the screen could not show them
# (hover still reads every row and key).
MIN_CELLS = 32
ALL_HEADS = "all heads"
MOSAIC_BACKGROUND = (0, 0, 0, 255)  # the gaps between tiles: the view's own black
# Token text on the axes of a head shown alone, once each token gets this many pixels.
TOKEN_LABEL_PIXELS = 12
EMPTY_MESSAGE = (
    "<b>Attention</b><br>For each new token, every head of a layer weighs the tokens before "
    "it. Each head will be a triangle: a row per query token, a column per token it can see, "
    "brighter where it looks. The prompt fills the triangle at once (prefill); each generated "
    "token adds a row (decode).<br><br><i>Send a message. Then pick a layer above, hover a "
    "cell to read a weight, and click a head to see it alone with its tokens; there, click a "
    "row, a cell or a token on its axes to select that step in every panel.</i>"
)


class AttentionPanel(StatePanel):
    """Per-head causal attention of a watched layer as one mosaic, plus a layer x head overview.

    The heads share one painted image (`MosaicView`): tile i shows head `slots[i]`, its rows
    and keys in buffer units, so hover reads the exact weight under the pointer.
    """

    # The layers the app should capture from the next reply on (the watched ones plus a pick).
    watched_layers_requested = Signal(tuple)
    # The layer the mosaic draws changed: only its rows need to cross from the engine.
    shown_layer_changed = Signal()
    # The cells a tile has room for changed by a power of two (`grid`): a prompt's matrix
    # crosses pooled near them.
    grid_changed = Signal()

    def __init__(self, state: InternalsState, parent: QWidget | None = None) -> None:
        super().__init__(state, ATTENTION, parent)
        self._lut = colour_table()
        self._pooled = PooledRows()
        self._choices_key: tuple[object, ...] = ()
        self._said_layer: int | None = None  # the shown layer shown_layer_changed last told
        # The mosaic as last drawn: its layout, the heads per tile, each tile's colour scale
        # (1 / its level) and the size of an image pixel in buffer units (keys, rows).
        # (it shadows QWidget.layout(), which nothing calls on the panel: the tests read this)
        self.layout: MosaicLayout | None = None  # type: ignore[assignment]
        self.slots: tuple[int, ...] = ()
        self.tile_scale = np.ones(0)
        self.pool_factors = (1, 1)  # buffer rows and keys per display cell
        self._pixel = (1.0, 1.0)
        self._image_buffer: np.ndarray | None = None
        self.grid: tuple[int, int] | None = None  # (rows, keys) cells of a tile, as last said
        self._awaited_cell: tuple[int, int, int] | None = None  # hovered, its weight on its way
        self._build_controls()
        self._build_mosaic()
        self.head_overview = HeadOverview(state, self._lut)
        self.head_overview.changed.connect(self.tracker.mark)
        self.head_overview.picked.connect(self.select)
        # what the tests and the docks read of it, by the names they had here
        self.overview = self.overview_image = self.head_overview.plot  # the grid, its `image`
        self.overview_caption = self.head_overview.caption
        self.measure_choice = self.head_overview.measure_choice
        self.hover = QLabel("Hover a heatmap to read a weight.")
        self.step_line = StepLine()
        grid_box = QWidget()
        grid_layout = QVBoxLayout(grid_box)
        grid_layout.setContentsMargins(0, 0, 0, 0)
        grid_layout.addWidget(self.mosaic, 1)
        grid_layout.addWidget(self.hover)
        # The overview under the mosaic, at the dock's full width: every head fits at any width.
        splitter = QSplitter(Qt.Orientation.Vertical)
        splitter.addWidget(grid_box)
        splitter.addWidget(self.head_overview)
        splitter.setStretchFactor(0, 3)
        splitter.setStretchFactor(1, 1)
        self.pages = EmptyState(EMPTY_MESSAGE, splitter)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(self._controls)
        layout.addWidget(self.step_line)
        layout.addWidget(self.pages, 1)

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
        self.all_heads = QPushButton("← all heads")
        self.all_heads.setToolTip("Back to every head of the layer")
        self.all_heads.clicked.connect(lambda: self.show_head(None))
        self.all_heads.setVisible(False)
        self.per_head_scale.toggled.connect(lambda _on: self.tracker.mark())
        self._controls = QHBoxLayout()
        for label, widget in (("Layer:", self.layer_choice), ("Head:", self.head_choice)):
            self._controls.addWidget(QLabel(label))
            self._controls.addWidget(widget)
        self._controls.addWidget(self.all_heads)
        self._controls.addWidget(self.per_head_scale)
        self._controls.addStretch(1)

    def _build_mosaic(self) -> None:
        self.mosaic = MosaicView(mosaic_colours(self._lut, MOSAIC_BACKGROUND))
        # Token text along the axes of a head shown alone, when there is room to read it.
        self.key_axis, self.query_axis = self.mosaic.key_axis, self.mosaic.query_axis
        self._token_ticks: tuple[object, ...] = ()
        self._marker_key: tuple[object, ...] = ()  # what the marker's path was drawn for
        self.marked_row: int | None = None  # the buffer row outlined on every tile
        self.mosaic.resized.connect(self._on_mosaic_resized)
        self.mosaic.hovered.connect(self._on_hover)
        self.mosaic.clicked.connect(self._on_mosaic_click)

    @property
    def selected_layer(self) -> int | None:
        data = self.layer_choice.currentData()
        return None if data is None else int(data)

    @property
    def shown_layer(self) -> int | None:
        """The layer whose rows the mosaic draws: the one chosen, else the one it will choose
        (the first watched) before its choices are filled in."""
        chosen = self.selected_layer
        if chosen is not None:
            return chosen
        state = self._state
        return (state.watched_layers or tuple(sorted(state.attention)) or (None,))[0]

    def _say_shown_layer(self) -> None:
        layer = self.shown_layer
        if layer != self._said_layer:
            self._said_layer = layer
            self.shown_layer_changed.emit()

    @property
    def selected_rows(self) -> AttentionRows | None:
        """The rows of the layer chosen in the picker (None: none chosen or none recorded)."""
        layer = self.selected_layer
        return self._state.attention.get(layer) if layer is not None else None

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

    def show_head(self, head: int | None) -> None:
        """One head alone, large, with its tokens; None: every head of the layer again."""
        self._sync_choices()
        index = 0 if head is None else self.head_choice.findData(head)
        if index >= 0:
            self.head_choice.setCurrentIndex(index)
        self.tracker.mark()

    def describe(self, head: int, row: int, key: int) -> str:
        """What the hover line says about one cell (row: index into the layer's buffer)."""
        rows = self.selected_rows
        if rows is None or not 0 <= row < rows.rows or not 0 <= key < rows.keys:
            return ""
        if self._waits((head, row, key)):
            self._state.want_prompt_rows()  # a prompt row that crossed pooled: its weights
        return describe_cell(self._state.token_text, rows, head, row, key)

    def cell_at(self, view_point: QPointF) -> tuple[int, int, int] | None:
        """(head, buffer row, key) under a point of the mosaic's view; None off the tiles."""
        if self.layout is None or self.mosaic.image is None:
            return None
        key_size, row_size = self._pixel
        found = self.layout.locate(view_point.y() / row_size, view_point.x() / key_size)
        if found is None:
            return None
        slot, inside_y, inside_x = found
        return self.slots[slot], math.floor(inside_y * row_size), math.floor(inside_x * key_size)

    def overview_cell(self, position: QPointF) -> tuple[int, int] | None:
        """The (layer, head) under a point of the overview's grid (`overview`), if any."""
        return self.head_overview.cell(position)

    def head_tile(self, head: int) -> np.ndarray:
        """The weights the tile of `head` shows, one per display cell (colour scale undone)."""
        if self.layout is None or self.mosaic.image is None or head not in self.slots:
            raise KeyError(f"head {head} is not in the mosaic")
        slot = self.slots.index(head)
        return np.asarray(self.layout.tile(self.mosaic.image, slot) / self.tile_scale[slot])

    def needs_redraw(self) -> bool:
        return self.tracker.stale or self.head_overview.wants_drawing()

    def prepare(self) -> None:
        """Pool the shown layer's new rows now (called after each delivered batch), so the
        next frame only composes the image: a frame after many tokens would otherwise pool
        them all at once, the window's longest stall at long contexts."""
        rows = self.selected_rows
        if rows is not None and rows.rows and self.isVisible():
            self._pooled.extend(rows)

    def redraw(self) -> None:
        revisions = self.tracker.snapshot()
        if self.tracker.stale:
            self._sync_choices()
            self.pages.show_content(bool(self._state.attention))
            self.all_heads.setVisible(self.selected_head is not None)
            self._draw_heads()
            self._draw_row_marker()
            self._say_arrived_weight()
            state = self._state
            line = attention_line(state, self.selected_layer, self.selected_head)
            self.step_line.say(line, state.showing_step)
        self.head_overview.redraw()
        self.tracker.drawn(revisions)

    # -- choices ---------------------------------------------------------------------------

    def _sync_choices(self) -> None:
        state = self._state
        layers = state.info.layers if state.info is not None else 0
        heads = state.info.heads if state.info is not None else 0
        recorded = set(state.attention)
        watched = recorded | set(state.watched_layers)
        names = tuple(
            (f"layer {layer}" + ("" if layer in watched else " (watch from the next reply)"), layer)
            for layer in sorted(set(range(layers)) | watched)
        )
        # A new chat forgets the recorded layers and its first reply records them again: the
        # same names, so the boxes are not filled again (twice per new chat).
        key = (names, heads)
        if key == self._choices_key:
            return
        self._choices_key = key
        shown = self.shown_layer  # the choice kept, else the first watched (or recorded) layer
        self.layer_choice.blockSignals(True)
        self.layer_choice.clear()
        for name, layer in names:
            self.layer_choice.addItem(name, layer)
        self.layer_choice.setCurrentIndex(max(self.layer_choice.findData(shown), 0))
        self.layer_choice.blockSignals(False)
        head = self.selected_head
        self.head_choice.blockSignals(True)
        self.head_choice.clear()
        self.head_choice.addItem(ALL_HEADS)
        for index in range(heads):
            self.head_choice.addItem(f"head {index}", index)
        self.head_choice.setCurrentIndex(max(self.head_choice.findData(head), 0))
        self.head_choice.blockSignals(False)
        self._say_shown_layer()

    def _on_layer_picked(self, _index: int) -> None:
        layer = self.selected_layer
        watched = self._state.watched_layers
        if layer is not None and layer not in watched:
            self.watched_layers_requested.emit(tuple(sorted({*watched, layer})))
        self.tracker.mark()
        self._say_shown_layer()

    # -- mosaic ----------------------------------------------------------------------------

    def _heads_to_show(self, heads: int) -> tuple[int, ...]:
        head = self.selected_head
        return (head,) if head is not None and head < heads else tuple(range(heads))

    def _tile_grid(self, tiles: int, aspect: float) -> tuple[int, int, int]:
        """Tile columns for the view's size and tiles `aspect` high per unit of width, and the
        most cells a tile's height and width need (about one per device pixel)."""
        size = self.mosaic.plot_rect().size()
        columns = best_columns(tiles, size.width(), size.height(), aspect)
        lines = math.ceil(tiles / columns)
        width = min(size.width() / columns, size.height() / lines / aspect)
        ratio = self.devicePixelRatioF()
        rows = max(math.ceil(width * aspect * ratio), MIN_CELLS)
        keys = max(math.ceil(width * ratio), MIN_CELLS)
        return columns, rows, keys

    def _on_mosaic_resized(self) -> None:
        # Other tile columns may fit better, and the cells follow the screen pixels.
        if self.layout is not None:
            self.tracker.mark()
        else:
            self._say_planned_grid()

    def _say_planned_grid(self) -> None:
        """Before any rows: the grid a long prompt's tiles will have (the flattest), so a
        first reply's long prompt crosses pooled too."""
        info = self._state.info
        if info is None or not info.heads:
            return
        tiles = 1 if self.selected_head is not None else info.heads
        _columns, rows, keys = self._tile_grid(tiles, FLATTEST_TILE)
        self._say_grid(min(rows, DISPLAY_ROWS), min(keys, DISPLAY_KEYS))

    def _draw_heads(self) -> None:
        layer, rows = self.selected_layer, self.selected_rows
        if rows is None or rows.rows == 0:
            self._clear_mosaic()
            self._say_planned_grid()
            if layer is not None and layer not in self._state.watched_layers:
                self.hover.setText(
                    f"Layer {layer} is not watched yet: it is recorded from the next reply."
                )
            return
        slots = self._heads_to_show(rows.heads)
        aspect = tile_aspect(rows.rows, rows.keys)
        columns, max_rows, max_keys = self._tile_grid(len(slots), aspect)
        matrix, row_factor, key_factor = self._pooled.update(rows, max_rows, max_keys)
        self.pool_factors = (row_factor, key_factor)
        if self._pooled.missing:  # a pooled prompt's cells do not pool to these factors
            self._state.want_prompt_rows()
        self._say_grid(min(max_rows, DISPLAY_ROWS), min(max_keys, DISPLAY_KEYS))
        tiles = matrix if len(slots) == rows.heads else matrix[list(slots)]
        if self.per_head_scale.isChecked():
            scale = 1.0 / self._pooled.levels()[list(slots)]
        else:
            scale = np.ones(len(slots))
        layout = MosaicLayout(len(slots), tiles.shape[1], tiles.shape[2], columns)
        image = layout.compose(tiles, scale, self._image_buffer)
        self._image_buffer = image
        self.mosaic.set_image(image, MOSAIC_LEVELS)
        up_rows, up_columns = layout.upsample
        pixel = (key_factor / up_columns, row_factor / up_rows)  # buffer units per pixel
        if (layout, pixel, slots) != (self.layout, self._pixel, self.slots):
            self._place(layout, pixel, slots)
        self.tile_scale = scale
        self._draw_token_axes(rows, slots)

    def _say_grid(self, rows: int, keys: int) -> None:
        """Tell the engine the cells a tile has room for when they moved to another power of
        two: the engine pools one power finer, so smaller moves still pool from its cells,
        and a grid that moves with every token (a short context) asks nothing each frame."""
        said = self.grid
        if said is not None and (rows.bit_length(), keys.bit_length()) == (
            said[0].bit_length(),
            said[1].bit_length(),
        ):
            return
        self.grid = (rows, keys)
        self.grid_changed.emit()

    def _place(
        self, layout: MosaicLayout, pixel: tuple[float, float], slots: tuple[int, ...]
    ) -> None:
        """Fit the view to a new extent; put each head's label on its tile."""
        self.layout, self._pixel, self.slots = layout, pixel, slots
        key_size, row_size = pixel
        height, width = layout.shape
        rect = QRectF(0, 0, width * key_size, height * row_size)
        # Tiles keep their rows x keys shape on screen (square cells), or FLATTEST_TILE when
        # flatter: x pixels per view unit (keys) over y's (rows).
        tile_height, tile_width = layout.tile_shape
        shape = tile_height * row_size / (tile_width * key_size)  # rows per key in a tile
        ratio = shape / min(max(shape, FLATTEST_TILE), 1.0)
        self.mosaic.set_view(rect, ratio)
        labels = []
        for slot, head in enumerate(slots):
            y, x = layout.origin(slot)
            labels.append((f"head {head}", QPointF((x + tile_width) * key_size, y * row_size)))
        self.mosaic.set_labels(labels)

    def _draw_token_axes(self, rows: AttentionRows, slots: tuple[int, ...]) -> None:
        """Token text on the axes of a lone head when each token has room; else hover only."""
        lone = len(slots) == 1 and self.pool_factors == (1, 1)
        key = (rows.serial, rows.rows, rows.keys, rows.dropped, self.mosaic.size()) if lone else ()
        if key == self._token_ticks:
            return
        self._token_ticks = key
        shown_before = self.key_axis.shown
        labels = self._token_labels(rows) if lone else None
        if labels is not None:
            self.mosaic.set_axes(*labels)
        else:
            self.mosaic.hide_axes()
        if (labels is not None) != shown_before:  # the axes took or gave back room
            QTimer.singleShot(0, self, self.tracker.mark)  # the cells follow the new area

    def _token_labels(
        self, rows: AttentionRows
    ) -> tuple[list[tuple[float, str]], list[tuple[float, str]]] | None:
        """(query rows' labels, keys' labels) of a lone head, (view position, text), when each
        token gets TOKEN_LABEL_PIXELS beside the axes; None when they would not. Judged with
        the axes' room taken whether they show now or not: judged on the room they leave
        when hidden, they could show, shrink the tile below the bar and hide again, frame
        after frame."""
        text = self._state.token_text
        queries = [(r + 0.5, axis_token(text(int(p)))) for r, p in enumerate(rows.positions)]
        area = self.mosaic.area_for(queries, keys=True)
        side = min(area.width(), area.height() / tile_aspect(rows.rows, rows.keys))
        if side < TOKEN_LABEL_PIXELS * rows.keys:
            return None
        # Across the top, words would run into each other: each key is also a row above (the
        # same token), so its position is enough there unless every word fits its column.
        words = [axis_token(text(k)) for k in range(rows.keys)]
        metrics = self.fontMetrics()
        fits = max(metrics.horizontalAdvance(word) for word in words) + 6 <= side / rows.keys
        labels = words if fits else [f"#{k}" for k in range(rows.keys)]
        return queries, [(k + 0.5, label) for k, label in enumerate(labels)]

    def _on_mosaic_click(self, position: QPointF) -> None:
        """A click on a head's tile shows it alone; on a lone head, a click on a cell or a
        query row's token selects that row's step everywhere, one on a key's token that key."""
        if self._select_from_axes(position):
            return
        point = self.mosaic.map_to_view(position)
        if point is None or not self.mosaic.plot_rect().contains(position):
            return
        cell = self.cell_at(point)
        if cell is None:
            return
        if self.selected_head is None:
            self.show_head(cell[0])
        else:
            self.select_row(cell[1])

    def _select_from_axes(self, position: QPointF) -> bool:
        """Select the token under `position` (widget pixels) on a lone head's axes; False
        when off them."""
        point = self.mosaic.map_to_view(position)
        if point is None:
            return False
        if self.mosaic.axis_rect(self.query_axis).contains(position):
            self.select_row(math.floor(point.y()))
            return True
        if self.mosaic.axis_rect(self.key_axis).contains(position):
            key = math.floor(point.x())
            if 0 <= key < len(self._state.trail.ids):
                self._state.select(key)
            return True
        return False

    def select_row(self, row: int) -> None:
        """Select, in every panel, the step whose attention is row `row` of the shown layer."""
        rows = self.selected_rows
        if rows is not None and 0 <= row < rows.rows:
            self._state.select(position_of_query(self._state, int(rows.positions[row])))

    def _draw_row_marker(self) -> None:
        """Outline the selected step's query row on every tile while a step is shown."""
        state, rows = self._state, self.selected_rows
        query = attention_query(state) if state.showing_step else None
        row = rows.index_of(query) if rows is not None and query is not None else None
        if row is None or self.layout is None:
            self.mosaic.set_marker(None)
            self.marked_row = None
            return
        key = (self.layout, self._pixel, self.slots, row)
        if key != self._marker_key or self.mosaic.marker is None:
            self._marker_key = key
            self.mosaic.set_marker(row_path(self.layout, self._pixel, len(self.slots), row))
        self.marked_row = row

    def _clear_mosaic(self) -> None:
        self._token_ticks = ()
        self.mosaic.clear()
        self.marked_row = None
        self.layout, self.slots = None, ()

    def _on_hover(self, point: QPointF) -> None:
        cell = self.cell_at(point)
        if cell is not None:
            text = self.describe(*cell)
            if text:
                self.hover.setText(text)
                self._awaited_cell = cell if self._waits(cell) else None

    def _waits(self, cell: tuple[int, int, int]) -> bool:
        """Whether the hovered cell's weight is a prompt weight still on its way."""
        rows = self.selected_rows
        _head, row, _key = cell
        if rows is None or not 0 <= row < rows.rows:
            return False
        return rows.waits_for(int(rows.positions[row]))

    def _say_arrived_weight(self) -> None:
        """The hover line of a cell whose weight was on its way, once it came (the pointer
        may not move again)."""
        cell = self._awaited_cell
        if cell is not None and not self._waits(cell):
            self._awaited_cell = None
            text = self.describe(*cell)
            if text:
                self.hover.setText(text)
