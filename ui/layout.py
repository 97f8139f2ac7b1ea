"""Fit the window to the screen it opens on: its first size, the default dock arrangement, and
whether a remembered layout still fits.

Everything here takes the screen's available geometry as an argument (the window's own screen
by default), so the same logic is tested at any screen size on a headless platform.

The default arrangement (Qt Creator and napari are the models):
- the chat in the middle keeps CHAT_MIN_WIDTH; settings and conversations on the left;
- the internals docks on the right in a grid of cells, as many cells as the room allows at
  about CELL each, the docks without a cell of their own tabbed into the cells: on a laptop
  every internals panel is a tab of one dock area, on a 4K monitor all of them are visible;
- too narrow for three columns (a netbook, a large scale factor), settings and conversations
  become tabs beside the internals panels;
- every dock's content scrolls once its dock is smaller than the panel's minimum, so docks
  never overlap whatever the user does with the separators.

A layout the user left is remembered per screen size and restored only where it fits: one
made for a larger screen gives way to this screen's default, one off screen (its monitor
unplugged) is moved onto it, and so is a floating panel.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from PySide6.QtCore import QByteArray, QEvent, QObject, QRect, QSettings, QSize, Qt, QTimer
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import (
    QDockWidget,
    QFrame,
    QMainWindow,
    QScrollArea,
    QStyle,
    QTabBar,
    QWidget,
)

CHAT_MIN_WIDTH = 380  # the chat and the message box below it stay usable
CHAT_WIDTH = 960  # lines longer than this read badly: on wide screens the panels get the rest
COMPACT = QSize(1600, 900)  # below either: a single column of tabs on each side
SIDE_WIDTH = 260  # settings and conversations
WIDE_SIDE_WIDTH = 320
CELL = QSize(520, 420)  # the least room one visible internals panel gets by default
MAX_ROWS = 2  # panels are wide rather than tall: never more than two cells stacked
SEPARATORS = 24  # dock separators and margins across the window
CHROME_HEIGHT = 110  # menu bar, toolbar, status bar and dock titles: not for panels
FULL_SCREEN_BELOW = 2000  # narrower screens get all their available area, wider ones 90 %
# The smallest a panel is laid out at; a dock smaller than this scrolls it.
PANEL_MINIMUM = QSize(320, 240)
PANEL_MINIMA = {"attention": QSize(440, 380), "timing": QSize(360, 420)}
# Which internals panels get a cell of their own first; the others follow in dock order.
PRIORITY = ("timing", "attention", "kv_cache", "next_token")

RIGHT = Qt.DockWidgetArea.RightDockWidgetArea
LEFT = Qt.DockWidgetArea.LeftDockWidgetArea


@dataclass(frozen=True)
class Arrangement:
    """Where things go on one screen: computed from its available geometry alone."""

    window: QRect
    side_width: int  # 0: no left column, settings and conversations are internals tabs
    side_tabbed: bool  # settings and conversations as two tabs rather than stacked
    internals_width: int
    columns: tuple[tuple[tuple[str, ...], ...], ...]  # columns of cells; a cell is a tab group

    @property
    def cells(self) -> int:
        return sum(len(column) for column in self.columns)


def is_compact(available: QRect) -> bool:
    return available.width() < COMPACT.width() or available.height() < COMPACT.height()


def first_start_geometry(available: QRect) -> QRect:
    """All of a laptop's screen; 90 % of a larger one, centred. Never larger than `available`."""
    if available.width() < FULL_SCREEN_BELOW:
        return QRect(available)
    size = QSize(round(available.width() * 0.9), round(available.height() * 0.9))
    rect = QRect(available.topLeft(), size)
    rect.moveCenter(available.center())
    return rect


def arrangement(available: QRect, internals: Sequence[str], side_minimum: int = 0) -> Arrangement:
    """The default layout of the window on a screen with this available geometry.

    `internals` names the internals docks in their menu order (any number of them);
    `side_minimum` is the least width the left column's docks take.
    """
    window = first_start_geometry(available)
    compact = is_compact(available)
    side = max(SIDE_WIDTH if compact else WIDE_SIDE_WIDTH, side_minimum)
    if window.width() < side + CHAT_MIN_WIDTH + PANEL_MINIMUM.width() + SEPARATORS:
        side = 0  # no room for three columns: the left column's docks join the internals tabs
    rest = window.width() - side
    share = max(round(rest * (0.55 if compact else 0.6)), rest - CHAT_WIDTH)
    internals_width = max(min(share, rest - CHAT_MIN_WIDTH), 0)
    rows = max(min((window.height() - CHROME_HEIGHT) // CELL.height(), MAX_ROWS), 1)
    columns = max(internals_width // CELL.width(), 1)
    cells = min(len(internals), rows * columns)
    if cells:  # as few columns as hold the cells: a spare column only narrows the others
        columns = math.ceil(cells / rows)
    grid = _grid(_cells(internals, cells), columns)
    return Arrangement(window, side, compact, internals_width, grid)


def _cells(names: Sequence[str], count: int) -> list[list[str]]:
    """`count` tab groups: the first `count` names by PRIORITY head one each, in dock order;
    every other name joins the group with the fewest tabs so far."""
    if count == 0:
        return []
    ranked = sorted(names, key=lambda n: PRIORITY.index(n) if n in PRIORITY else len(PRIORITY))
    heads = sorted(ranked[:count], key=names.index)
    groups = [[head] for head in heads]
    for name in names:
        if name not in heads:
            min(groups, key=len).append(name)
    return groups


def _grid(cells: list[list[str]], columns: int) -> tuple[tuple[tuple[str, ...], ...], ...]:
    """Cells into columns, top to bottom then left to right, the first columns fullest."""
    per_column = math.ceil(len(cells) / columns) if cells else 0
    return tuple(
        tuple(tuple(cell) for cell in cells[start : start + per_column])
        for start in range(0, len(cells), per_column or 1)
    )


# -- applying it ---------------------------------------------------------------------------------


def available_geometry(widget: QWidget) -> QRect:
    """The available geometry (without taskbars and panels) of the screen `widget` opens on."""
    screen = widget.screen() or QGuiApplication.primaryScreen()
    return screen.availableGeometry()


def arrange(
    window: QMainWindow,
    internals: Mapping[str, QDockWidget],
    side: Sequence[QDockWidget],
    available: QRect,
) -> Arrangement:
    """Size and place `window` on `available` and lay its docks out as `arrangement` says."""
    side_minimum = max((dock.minimumSizeHint().width() for dock in side), default=0)
    plan = arrangement(available, list(internals), side_minimum)
    window.setGeometry(plan.window)
    tops = _arrange_internals(window, internals, plan)
    _arrange_side(window, side, plan, tops[0][0] if tops else None)
    firsts = [column[0] for column in tops]
    if firsts:
        width = plan.internals_width // len(firsts)
        left = list(side[:1]) if plan.side_width else []
        widths = [plan.side_width] * len(left) + [width] * len(firsts)
        window.resizeDocks([*left, *firsts], widths, Qt.Orientation.Horizontal)
    for column in tops:
        if len(column) > 1:
            height = plan.window.height() // len(column)
            window.resizeDocks(column, [height] * len(column), Qt.Orientation.Vertical)
    return plan


def _arrange_side(
    window: QMainWindow,
    side: Sequence[QDockWidget],
    plan: Arrangement,
    first_cell: QDockWidget | None,
) -> None:
    if not plan.side_width and first_cell is not None:
        for dock in side:
            window.tabifyDockWidget(first_cell, dock)
            dock.show()
        first_cell.raise_()
        return
    for dock in side:
        window.addDockWidget(LEFT, dock, Qt.Orientation.Vertical)
        dock.show()
    if plan.side_tabbed and len(side) > 1:
        for dock in side[1:]:
            window.tabifyDockWidget(side[0], dock)
        side[0].raise_()
    elif len(side) > 1:
        heights = [round(plan.window.height() * 0.55)] + [plan.window.height() // 3] * (
            len(side) - 1
        )
        window.resizeDocks(list(side), heights, Qt.Orientation.Vertical)


def _arrange_internals(
    window: QMainWindow, docks: Mapping[str, QDockWidget], plan: Arrangement
) -> list[list[QDockWidget]]:
    """Place the cells' first docks as a grid, tab the others onto them; the grid's docks."""
    for dock in docks.values():
        window.removeDockWidget(dock)  # out of the tab groups they were built in
    # Columns first, then each split into its rows: splitting a dock that already has a dock
    # below it would place the new column beside that pair's lower half.
    grid = [[docks[column[0][0]]] for column in plan.columns]
    for index, (top,) in enumerate(grid):
        if index:
            window.splitDockWidget(grid[index - 1][0], top, Qt.Orientation.Horizontal)
        else:
            window.addDockWidget(RIGHT, top)
        top.show()
    for tops, column in zip(grid, plan.columns, strict=True):
        for cell in column[1:]:
            head = docks[cell[0]]
            window.splitDockWidget(tops[-1], head, Qt.Orientation.Vertical)
            head.show()
            tops.append(head)
    heads = [dock for column in grid for dock in column]
    cells = [cell for column in plan.columns for cell in column]
    for head, cell in zip(heads, cells, strict=True):
        for name in cell[1:]:
            window.tabifyDockWidget(head, docks[name])
            docks[name].show()
        head.raise_()
    return grid


class FitOrScroll(QScrollArea):
    """Lays its widget out at the size of the view, but never below the widget's minimum:
    beyond that it scrolls. (A plain resizable QScrollArea lays out a widget with wrapped text
    at its preferred height for the width, so plots that would fit scroll instead.)"""

    def __init__(self, content: QWidget, horizontal: bool = True) -> None:
        super().__init__()
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setWidget(content)
        if not horizontal:  # as wide as the content needs, scrolled only up and down
            self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
            bar = self.style().pixelMetric(QStyle.PixelMetric.PM_ScrollBarExtent)
            self.setMinimumWidth(needed(content).width() + bar)
        self.viewport().installEventFilter(self)  # scroll bars shown or hidden resize it

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self.viewport() and event.type() == QEvent.Type.Resize:
            self.fit()
        return False

    def fit(self) -> None:
        content = self.widget()
        if content is None:
            return
        size = self.viewport().size().expandedTo(needed(content))
        if content.size() != size:
            content.resize(size)


def needed(widget: QWidget) -> QSize:
    return widget.minimumSize().expandedTo(widget.minimumSizeHint())


def scroll_when_small(
    dock: QDockWidget, minimum: QSize | None = None, horizontal: bool = True
) -> FitOrScroll:
    """Put the dock's content in a scroll area: below `minimum` it scrolls instead of being
    squeezed (or spilling over its neighbours, when the docks' minima outgrow the window).
    Not `horizontal`: the dock is kept as wide as its content needs."""
    content = dock.widget()
    # Never below what its own layout needs: that would squeeze its widgets over each other.
    content.setMinimumSize(needed(content).expandedTo(minimum or PANEL_MINIMUM))
    area = FitOrScroll(content, horizontal)
    area.setObjectName(f"{dock.objectName()}_scroll")
    dock.setWidget(area)
    return area


def panel_minimum(name: str) -> QSize:
    return PANEL_MINIMA.get(name, PANEL_MINIMUM)


# -- remembered layouts --------------------------------------------------------------------------

# The latest layout is kept under LATEST, and a copy under a key for the size of the screen
# it was made on: a laptop plugged into a monitor now and then gets each screen's own back.
LATEST = "window"
GEOMETRY, MAXIMIZED, STATE = "normal_geometry", "maximized", "state"


def screen_key(available: QRect) -> str:
    return f"layouts/{available.width()}x{available.height()}"


def place_saved(saved: QRect, available: QRect, screens: Sequence[QRect] = ()) -> QRect | None:
    """Where a window saved at `saved` goes now, or None when it no longer fits.

    Still wholly on one of `screens` (available geometries): where it was. Small enough for
    `available` but off it (its screen unplugged, the resolution lowered): moved onto it.
    Larger than `available` (saved on a bigger monitor): None, and the caller uses the default
    for this screen rather than squeezing a layout made for more room.
    """
    if not saved.isValid():
        return None
    if any(screen.contains(saved) for screen in screens):
        return QRect(saved)
    if saved.width() > available.width() or saved.height() > available.height():
        return None
    placed = QRect(saved)
    placed.moveLeft(min(max(saved.left(), available.left()), available.right() - saved.width() + 1))
    placed.moveTop(min(max(saved.top(), available.top()), available.bottom() - saved.height() + 1))
    return placed


def save(window: QMainWindow, settings: QSettings, version: int, available: QRect) -> None:
    """Keep the layout as the latest and as that of screens of `available`'s size."""
    for group in (LATEST, screen_key(available)):
        settings.beginGroup(group)
        settings.setValue(GEOMETRY, window.normalGeometry())
        settings.setValue(MAXIMIZED, window.isMaximized())
        settings.setValue(STATE, window.saveState(version))
        settings.endGroup()
    settings.sync()


def restore(
    window: QMainWindow,
    settings: QSettings,
    version: int,
    available: QRect,
    screens: Sequence[QRect] = (),
) -> bool:
    """Put the window and its docks back as last left on a screen of this size, else as last
    left anywhere, if that fits; False leaves them untouched."""
    return any(
        _restore_group(window, settings, group, version, available, screens)
        for group in (screen_key(available), LATEST)
    )


def _restore_group(
    window: QMainWindow,
    settings: QSettings,
    group: str,
    version: int,
    available: QRect,
    screens: Sequence[QRect],
) -> bool:
    settings.beginGroup(group)
    saved, state = settings.value(GEOMETRY), settings.value(STATE)
    maximized = settings.value(MAXIMIZED, False, bool)
    settings.endGroup()
    if not isinstance(saved, QRect) or not isinstance(state, QByteArray):
        return False
    placed = place_saved(saved, available, screens)
    if placed is None:
        return False
    window.setGeometry(placed)
    if maximized:
        window.setWindowState(window.windowState() | Qt.WindowState.WindowMaximized)
    if not window.restoreState(state, version):
        return False
    for dock in window.findChildren(QDockWidget):
        if dock.isFloating():
            dock.setGeometry(float_on_screen(dock.geometry(), available, screens))
    return True


def float_on_screen(saved: QRect, available: QRect, screens: Sequence[QRect] = ()) -> QRect:
    """A floating dock's place: as saved where that still fits, else moved (and shrunk if it
    must be) onto `available`, so that no panel opens where nobody can see it."""
    placed = place_saved(saved, available, screens)
    if placed is not None:
        return placed
    size = saved.size().boundedTo(available.size())
    return place_saved(QRect(saved.topLeft(), size), available) or QRect(available)


def screens_available() -> list[QRect]:
    return [screen.availableGeometry() for screen in QGuiApplication.screens()]


class WholeTabNames(QObject):
    """The window's dock tab bars show each panel's whole name, with scroll arrows where the
    names do not fit: cut to fit, eight panels on a laptop's screen read 'Ti…', 'KV c…'.
    Qt makes those tab bars as docks are tabbed together (the user can, at any time), so each
    is set as it joins the window."""

    def __init__(self, window: QMainWindow) -> None:
        super().__init__(window)
        window.installEventFilter(self)
        for bar in window.findChildren(QTabBar):
            whole_names(bar)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.ChildPolished:  # a child made and set up: a tab bar?
            child = event.child()  # type: ignore[attr-defined]  # a QChildEvent
            if isinstance(child, QTabBar):
                whole_names(child)
        return False


def whole_names(bar: QTabBar) -> None:
    bar.setElideMode(Qt.TextElideMode.ElideNone)
    bar.setUsesScrollButtons(True)


class KeepFrameOnScreen(QObject):
    """Once the window is shown with its frame (title bar, borders), shrink and move it so the
    frame too lies within the available area (`available`, or that of the screen it was shown
    on). An X11 window manager adds the frame only some time after the window is shown, so
    the frame is checked again a little later."""

    RECHECK_MS = (0, 300, 1000)

    def __init__(self, window: QWidget, available: QRect | None = None) -> None:
        super().__init__(window)
        self._window, self._available = window, available
        window.installEventFilter(self)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if watched is self._window and event.type() == QEvent.Type.Show:
            self._window.removeEventFilter(self)
            self.fit()
            for delay in self.RECHECK_MS:
                QTimer.singleShot(delay, self, self.fit)
        return False

    def fit(self) -> None:
        fit_frame(self._window, self._available or available_geometry(self._window))


def fit_frame(window: QWidget, available: QRect) -> None:
    frame, inner = window.frameGeometry(), window.geometry()
    if available.contains(frame) or window.isMaximized():
        return
    extra_w, extra_h = frame.width() - inner.width(), frame.height() - inner.height()
    width = min(inner.width(), available.width() - extra_w)
    height = min(inner.height(), available.height() - extra_h)
    window.resize(max(width, 1), max(height, 1))
    window.move(
        min(max(frame.left(), available.left()), available.right() - width - extra_w + 1),
        min(max(frame.top(), available.top()), available.bottom() - height - extra_h + 1),
    )
