"""The window fits the screen it opens on: the assembled window at four screen sizes, the
default arrangement for any number of docks, and remembered layouts that no longer fit.

The headless platform has one fixed screen, so each test hands the window the available
geometry of the screen it pretends to open on (assemble's `screen`)."""

from __future__ import annotations

import itertools

import pytest
from PySide6.QtCore import QPoint, QRect, QSettings, QSize, Qt
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QMainWindow,
    QScrollArea,
    QTabBar,
    QWidget,
)

from app.window import assembly
from engine.settings import LoadRequest
from tests.engines import in_memory
from tests.ui.fakes import FakeBackend
from ui import layout

SCREENS = {
    "1024x600": QRect(0, 0, 1024, 600),  # a netbook, or 2048x1200 at twice the scale
    "1280x720": QRect(0, 0, 1280, 720),
    "1366x768": QRect(0, 0, 1366, 768),
    "1920x1080": QRect(0, 0, 1920, 1080),
    "3840x2160": QRect(0, 0, 3840, 2160),
    "1080x1920": QRect(0, 0, 1080, 1920),  # a monitor turned upright
}
INTERNALS = ("timing", "kv_cache", "attention", "next_token", "roofline")


@pytest.fixture
def open_window(qtbot, tmp_path):
    """Assemble the window for a screen, on a scratch database and layout file, model loaded."""
    opened = []

    def open_(screen: QRect, name: str = "layout.ini"):
        backend = FakeBackend()
        worker = in_memory(backend.load, backend.make_session)
        settings = QSettings(str(tmp_path / name), QSettings.Format.IniFormat)
        parts = assembly.assemble(
            worker, database=tmp_path / "chats.sqlite3", settings=settings, screen=screen
        )
        qtbot.addWidget(parts.window)
        parts.window.show()
        qtbot.waitExposed(parts.window)
        with qtbot.waitSignal(worker.loaded, timeout=5000):
            parts.window.load_model(LoadRequest(spec="fake-135M"))
        qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
        opened.append(parts)
        return parts

    yield open_
    for parts in opened:
        parts.window.close()
        parts.shutdown()


def in_window(widget: QWidget) -> QRect:
    """The part of `widget` that can be seen: its rect clipped by every parent, in window
    coordinates (a widget scrolled out of its scroll area's viewport is not there)."""
    window = widget.window()
    rect = QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())
    parent = widget.parentWidget()
    while parent is not None and parent is not window:
        rect = rect.intersected(QRect(parent.mapTo(window, QPoint(0, 0)), parent.size()))
        parent = parent.parentWidget()
    return rect


def on_screen(widget: QWidget) -> bool:
    return widget.isVisible() and not widget.visibleRegion().isEmpty()


def visible_parts(root: QWidget) -> list[QRect]:
    """`root` and every descendant widget showing something, clipped (see in_window)."""
    widgets = [root, *root.findChildren(QWidget)]
    rects = [in_window(w) for w in widgets if w.isVisible() and w.window() is root.window()]
    return [r for r in rects if not r.isEmpty()]


def regions(window) -> dict[str, list[QRect]]:
    """Each shown dock's visible widgets, the chat's and the status bar's."""
    shown = {d.objectName(): d for d in window.findChildren(QDockWidget) if on_screen(d)}
    parts = {name: visible_parts(dock) for name, dock in shown.items()}
    parts["chat"] = visible_parts(window.centralWidget())
    parts["status bar"] = visible_parts(window.statusBar())
    return parts


@pytest.mark.parametrize("size", SCREENS)
def test_the_window_fits_the_screen_and_nothing_overlaps(open_window, size):
    screen = SCREENS[size]
    window = open_window(screen).window
    assert screen.contains(window.frameGeometry())

    parts = regions(window)
    assert len(parts) >= 3  # at least one dock, the chat, the status bar
    for (a, rects_a), (b, rects_b) in itertools.combinations(parts.items(), 2):
        for ra, rb in itertools.product(rects_a, rects_b):
            assert not ra.intersects(rb), f"{a} {ra} overlaps {b} {rb} at {size}"


@pytest.mark.parametrize("size", SCREENS)
def test_the_message_box_and_status_bar_are_whole_and_usable(open_window, size):
    window = open_window(SCREENS[size]).window
    inside = window.rect()
    for widget in (window.input, window.statusBar(), window.model_label):
        assert on_screen(widget)
        assert in_window(widget) == QRect(widget.mapTo(window, QPoint(0, 0)), widget.size())
        assert inside.contains(in_window(widget))
    assert window.input.width() >= layout.CHAT_MIN_WIDTH - 80  # the send buttons beside it
    assert window.centralWidget().width() >= layout.CHAT_MIN_WIDTH


@pytest.mark.parametrize("size", SCREENS)
def test_a_dock_smaller_than_its_panel_scrolls_rather_than_squeezes(open_window, size):
    parts = open_window(SCREENS[size])
    for name, dock in parts.internals.docks.items():
        area = dock.widget()
        assert isinstance(area, QScrollArea)
        panel = area.widget()
        assert panel.minimumWidth() >= layout.panel_minimum(name).width()
        if on_screen(dock):  # laid out at its minimum at least; the scroll bars reach the rest
            assert panel.width() >= panel.minimumWidth()
            assert panel.height() >= panel.minimumHeight()


def test_small_screens_tab_the_internals_large_ones_show_them_all(open_window):
    small = open_window(SCREENS["1366x768"], "small.ini")
    shown = [n for n, d in small.internals.docks.items() if on_screen(d)]
    assert shown == ["timing"]  # one tab group: the others are tabs behind it
    tabified = small.window.tabifiedDockWidgets(small.internals.docks["timing"])
    assert {d.objectName() for d in tabified} == {
        d.objectName() for n, d in small.internals.docks.items() if n != "timing"
    }
    laptop_sidebar = small.window.findChild(QDockWidget, "conversations_dock")
    assert small.window.settings_dock in small.window.tabifiedDockWidgets(laptop_sidebar)

    full_hd = open_window(SCREENS["1920x1080"], "full_hd.ini")
    assert [n for n, d in full_hd.internals.docks.items() if on_screen(d)] == [
        "timing",
        "attention",
    ]
    large = open_window(SCREENS["3840x2160"], "large.ini")
    assert all(on_screen(d) for d in large.internals.docks.values())


def test_too_narrow_for_three_columns_the_settings_become_internals_tabs(open_window):
    parts = open_window(SCREENS["1024x600"])
    tabs = parts.window.tabifiedDockWidgets(parts.internals.docks["timing"])
    assert parts.window.settings_dock in tabs
    assert parts.window.findChild(QDockWidget, "conversations_dock") in tabs
    assert on_screen(parts.internals.docks["timing"])


@pytest.mark.parametrize("count", range(1, 9))
@pytest.mark.parametrize("size", SCREENS)
def test_every_dock_is_placed_once_whatever_their_number(size, count):
    names = [f"panel_{i}" for i in range(count)]
    plan = layout.arrangement(SCREENS[size], names)
    placed = [name for column in plan.columns for cell in column for name in cell]
    assert sorted(placed) == sorted(names)
    assert SCREENS[size].contains(plan.window)
    assert plan.cells <= count
    assert max(len(column) for column in plan.columns) <= layout.MAX_ROWS
    assert plan.window.width() - plan.side_width - plan.internals_width >= layout.CHAT_MIN_WIDTH


def test_the_most_telling_panels_get_the_first_cells():
    plan = layout.arrangement(SCREENS["1920x1080"], list(INTERNALS))
    assert [cell[0] for column in plan.columns for cell in column] == ["timing", "attention"]
    plan = layout.arrangement(SCREENS["1366x768"], list(INTERNALS))
    assert plan.columns == ((INTERNALS,),)


def test_the_window_opens_on_its_screen_not_at_the_origin():
    second = QRect(1920, 0, 2560, 1440)  # a second monitor right of the first
    window = layout.first_start_geometry(second)
    assert second.contains(window)
    assert window.size().width() <= second.width() and window.height() <= second.height()


# -- remembered layouts ------------------------------------------------------------------------


def test_a_saved_place_is_kept_moved_or_refused():
    laptop = QRect(0, 0, 1366, 768)
    assert layout.place_saved(QRect(10, 10, 1200, 700), laptop) == QRect(10, 10, 1200, 700)
    moved = layout.place_saved(QRect(3000, 900, 1200, 700), laptop)  # its monitor is gone
    assert moved is not None and moved.size() == QSize(1200, 700) and laptop.contains(moved)
    assert layout.place_saved(QRect(0, 0, 3456, 1944), laptop) is None  # made for 4K
    monitor = QRect(1366, 0, 1920, 1080)
    kept = layout.place_saved(QRect(1500, 50, 1600, 900), laptop, [laptop, monitor])
    assert kept == QRect(1500, 50, 1600, 900)  # still on the second monitor
    assert layout.place_saved(QRect(), laptop) is None


def test_a_layout_saved_on_a_large_monitor_is_not_restored_on_a_laptop(open_window):
    large = open_window(SCREENS["3840x2160"])
    assert all(on_screen(d) for d in large.internals.docks.values())
    large.window.close()  # saves the layout

    laptop = SCREENS["1366x768"]
    small = open_window(laptop)
    assert laptop.contains(small.window.frameGeometry())
    assert [n for n, d in small.internals.docks.items() if on_screen(d)] == ["timing"]
    assert small.window.restore_layout(laptop) is False


def test_a_layout_saved_off_screen_is_moved_onto_it(open_window, tmp_path):
    screen = SCREENS["1920x1080"]
    first = open_window(screen)
    first.internals.docks["kv_cache"].close()  # a change of the user's own
    first.window.close()
    settings = QSettings(str(tmp_path / "layout.ini"), QSettings.Format.IniFormat)
    for group in (layout.LATEST, layout.screen_key(screen)):
        settings.setValue(f"{group}/{layout.GEOMETRY}", QRect(2500, 1400, 1200, 700))
    settings.sync()

    again = open_window(screen)
    assert again.window.geometry().size() == QSize(1200, 700)
    assert screen.contains(again.window.frameGeometry())
    assert not again.internals.docks["kv_cache"].isVisible()  # the rest of it was restored


def test_each_screen_size_gets_its_own_layout_back(open_window):
    monitor, laptop = SCREENS["3840x2160"], SCREENS["1366x768"]
    at_desk = open_window(monitor)
    at_desk.internals.docks["roofline"].close()
    at_desk.window.close()
    on_the_road = open_window(laptop)  # too small for the monitor's layout: this one's default
    assert not on_the_road.internals.docks["roofline"].isHidden()
    on_the_road.window.close()

    back = open_window(monitor)  # the monitor's layout, not the laptop's latest
    assert back.window.geometry().size() == at_desk.window.geometry().size()
    docks = back.internals.docks
    assert docks["roofline"].isHidden()
    assert all(on_screen(dock) for name, dock in docks.items() if name != "roofline")


def test_a_layout_that_fits_comes_back_as_it_was(open_window):
    screen = SCREENS["1920x1080"]
    first = open_window(screen)
    first.window.setGeometry(QRect(100, 80, 1500, 900))
    first.window.tabifyDockWidget(
        first.internals.docks["timing"], first.internals.docks["attention"]
    )
    first.window.close()

    again = open_window(screen)
    assert again.window.geometry() == QRect(100, 80, 1500, 900)
    tabbed = again.window.tabifiedDockWidgets(again.internals.docks["timing"])
    assert again.internals.docks["attention"] in tabbed


def test_a_floating_panel_saved_off_screen_comes_back_onto_it(open_window):
    screen = SCREENS["1366x768"]
    first = open_window(screen)
    dock = first.internals.docks["attention"]
    dock.setFloating(True)
    dock.setGeometry(QRect(2400, 1300, 700, 600))  # on a monitor that is gone
    first.window.close()

    again = open_window(screen)
    dock = again.internals.docks["attention"]
    assert dock.isFloating()
    assert screen.contains(dock.geometry())
    assert dock.size() == QSize(700, 600)


def test_a_floating_panel_too_large_for_the_screen_is_shrunk_onto_it():
    laptop = SCREENS["1366x768"]
    placed = layout.float_on_screen(QRect(2400, 1300, 2000, 600), laptop)
    assert laptop.contains(placed) and placed.size() == QSize(1366, 600)
    assert layout.float_on_screen(QRect(10, 10, 700, 600), laptop) == QRect(10, 10, 700, 600)


def test_the_window_benchs_docked_layout_is_a_desktops_not_the_offscreen_platforms(open_window):
    """`glassbox bench --window --window-layout docked` measures the first start's layout of a
    1600x1000 desktop window (Timing and Attention drawn), not the small offscreen screen's
    single tab group; docked-layers puts the Layers tab in front of Attention's."""
    from app.bench.window import arrange_docks, layout_screen

    assert layout_screen("floating") is None and layout_screen("closed") is None
    docked = open_window(layout_screen("docked"), "docked.ini")
    arrange_docks(docked, "docked")
    assert [n for n, d in docked.internals.docks.items() if on_screen(d)] == [
        "timing",
        "attention",
    ]
    lens = open_window(layout_screen("docked-layers"), "layers.ini")
    arrange_docks(lens, "docked-layers")
    QApplication.processEvents()
    assert [n for n, d in lens.internals.docks.items() if on_screen(d)] == ["timing", "layers"]


def test_dock_tabs_show_whole_names_with_arrows_where_they_do_not_fit(qtbot):
    """Tab bars Qt makes later (docks tabbed together after the window was set up) too."""
    window = QMainWindow()
    qtbot.addWidget(window)
    layout.WholeTabNames(window)
    docks = []
    for name in ("Timing", "KV cache", "Attention", "Next token", "Roofline", "Placement"):
        dock = QDockWidget(name, window)
        dock.setObjectName(name)
        dock.setWidget(QWidget())
        window.addDockWidget(layout.RIGHT, dock)
        docks.append(dock)
    for dock in docks[1:]:
        window.tabifyDockWidget(docks[0], dock)
    window.resize(500, 400)
    window.show()
    qtbot.waitExposed(window)
    bars = [bar for bar in window.findChildren(QTabBar) if bar.count() > 1]
    assert bars, "the docks were tabbed into a tab bar"
    for bar in bars:
        assert bar.elideMode() == Qt.TextElideMode.ElideNone and bar.usesScrollButtons()
