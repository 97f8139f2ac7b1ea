"""The conversation sidebar: what it shows and the signals it sends."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLineEdit, QMenu

from ui.conversation_list import (
    BADGE_COLOR,
    CLIENT_ROLE,
    ConversationList,
    ConversationRow,
    api_client,
)

ROWS = [
    ConversationRow(3, "Newest", 1_700_000_300.0),
    ConversationRow(2, "Middle", 1_700_000_200.0),
    ConversationRow(1, "Oldest", 1_700_000_100.0),
]


@pytest.fixture
def sidebar(qtbot):
    widget = ConversationList()
    qtbot.addWidget(widget)
    widget.resize(300, 400)
    widget.set_conversations(ROWS)
    widget.show()
    qtbot.waitExposed(widget)
    return widget


def click_row(qtbot, sidebar: ConversationList, conversation_id: int) -> None:
    item = sidebar.list.item(sidebar.ids().index(conversation_id))
    centre = sidebar.list.visualItemRect(item).center()
    qtbot.mouseClick(sidebar.list.viewport(), Qt.MouseButton.LeftButton, pos=centre)


def action(menu: QMenu, *path: str):
    for name in path[:-1]:
        menu = next(a.menu() for a in menu.actions() if a.text() == name)
    return next(a for a in menu.actions() if a.text() == path[-1])


def test_rows_are_shown_in_the_order_given(sidebar):
    assert sidebar.ids() == [3, 2, 1]
    assert [sidebar.list.item(i).text() for i in range(3)] == ["Newest", "Middle", "Oldest"]
    assert "Updated" in sidebar.list.item(0).toolTip()
    assert sidebar.empty_label.isHidden() and not sidebar.list.isHidden()
    sidebar.set_conversations([])
    assert sidebar.ids() == [] and not sidebar.empty_label.isHidden()
    assert sidebar.empty_label.text() == "No conversations yet"


def test_a_placed_row_takes_its_place_by_recency_and_replaces_its_old_row(sidebar):
    """As the store orders them: updated, then id, newest first; the other rows untouched."""
    middle, oldest = sidebar.list.item(1), sidebar.list.item(2)
    sidebar.set_current(1)
    sidebar.place(ConversationRow(1, "Oldest, now written to", 1_700_000_400.0))
    assert sidebar.ids() == [1, 3, 2] and sidebar.list.item(0).text() == "Oldest, now written to"
    assert sidebar.list.item(2) is middle and oldest not in [sidebar.list.item(i) for i in range(3)]
    assert sidebar.list.currentItem() is sidebar.list.item(0)
    sidebar.place(ConversationRow(2, "Middle", 1_700_000_400.0))  # a tie: the larger id first
    assert sidebar.ids() == [2, 1, 3]
    sidebar.place(ConversationRow(9, "New", 1_700_000_350.0))  # not shown yet: inserted
    assert sidebar.ids() == [2, 1, 9, 3]


def test_clicking_a_row_asks_to_open_it_once(qtbot, sidebar):
    opened: list[int] = []
    sidebar.open_requested.connect(opened.append)
    click_row(qtbot, sidebar, 2)
    assert opened == [2]
    sidebar.set_current(2)  # what the app does once it has opened it
    with qtbot.assertNotEmitted(sidebar.open_requested):
        click_row(qtbot, sidebar, 2)
    assert sidebar.current_id() == 2 and sidebar.list.currentItem().text() == "Middle"


def test_enter_opens_the_highlighted_row(qtbot, sidebar):
    sidebar.list.setFocus()
    sidebar.list.setCurrentRow(2)
    with qtbot.waitSignal(sidebar.open_requested) as opened:
        qtbot.keyClick(sidebar.list, Qt.Key.Key_Return)
    assert opened.args == [1]


def test_refreshing_keeps_the_open_row_highlighted_without_signals(qtbot, sidebar):
    sidebar.set_current(1)
    with qtbot.assertNotEmitted(sidebar.open_requested):
        sidebar.set_conversations([ROWS[2], ROWS[0]])
    assert sidebar.ids() == [1, 3] and sidebar.list.currentItem().text() == "Oldest"
    sidebar.set_current(None)
    assert sidebar.list.currentItem() is None


def test_new_chat_button(qtbot, sidebar):
    with qtbot.waitSignal(sidebar.new_requested):
        qtbot.mouseClick(sidebar.new_button, Qt.MouseButton.LeftButton)


def test_search_is_sent_once_typing_pauses(qtbot, sidebar):
    seen: list[str] = []
    sidebar.search_changed.connect(seen.append)
    with qtbot.waitSignal(sidebar.search_changed) as searched:
        qtbot.keyClicks(sidebar.search_field, "rome")
    assert searched.args == ["rome"] and seen == ["rome"]  # not once per key
    sidebar.set_conversations([])
    assert sidebar.empty_label.text() == "No matches"
    with qtbot.waitSignal(sidebar.search_changed, timeout=100) as searched:
        qtbot.keyClick(sidebar.search_field, Qt.Key.Key_Return)  # Enter sends at once
    assert searched.args == ["rome"]


def find_editor(sidebar: ConversationList) -> QLineEdit:
    editors = sidebar.list.viewport().findChildren(QLineEdit)
    assert len(editors) == 1
    return editors[0]


def test_rename_from_the_menu_edits_in_place(qtbot, sidebar):
    action(sidebar.menu_for(2), "Rename").trigger()
    editor = find_editor(sidebar)
    editor.setText("  Better\n title ")
    with qtbot.waitSignal(sidebar.rename_requested) as renamed:
        qtbot.keyClick(editor, Qt.Key.Key_Return)
    assert renamed.args == [2, "Better title"]
    assert sidebar.list.item(1).text() == "Better title"


def test_a_blank_rename_is_refused(qtbot, sidebar):
    sidebar.start_rename(3)
    editor = find_editor(sidebar)
    editor.setText("   ")
    with qtbot.assertNotEmitted(sidebar.rename_requested):
        qtbot.keyClick(editor, Qt.Key.Key_Return)
    assert sidebar.list.item(0).text() == "Newest"


def test_export_actions(qtbot, sidebar):
    with qtbot.waitSignal(sidebar.export_requested) as exported:
        action(sidebar.menu_for(1), "Export", "Markdown…").trigger()
    assert exported.args == [1, "md"]
    with qtbot.waitSignal(sidebar.export_requested) as exported:
        action(sidebar.menu_for(3), "Export", "JSON…").trigger()
    assert exported.args == [3, "json"]


def test_open_from_the_menu(qtbot, sidebar):
    with qtbot.waitSignal(sidebar.open_requested) as opened:
        action(sidebar.menu_for(1), "Open").trigger()
    assert opened.args == [1]


def test_delete_hides_the_row_and_undo_brings_it_back(qtbot, sidebar):
    sidebar.set_current(3)
    with qtbot.waitSignal(sidebar.delete_requested) as deleted:
        action(sidebar.menu_for(2), "Delete").trigger()
    assert deleted.args == [2]
    assert sidebar.ids() == [3, 1] and sidebar.pending_delete() == 2
    assert not sidebar.undo_bar.isHidden() and "Middle" in sidebar.undo_label.text()
    assert sidebar.list.currentItem().text() == "Newest"  # the open chat stays highlighted

    # The app refreshes from the store, which still lists it until the delete lands.
    sidebar.set_conversations(ROWS)
    assert sidebar.ids() == [3, 1]

    with qtbot.waitSignal(sidebar.restore_requested) as restored:
        qtbot.mouseClick(sidebar.undo_button, Qt.MouseButton.LeftButton)
    assert restored.args == [2]
    assert sidebar.ids() == [3, 2, 1] and sidebar.undo_bar.isHidden()
    assert sidebar.pending_delete() is None


def test_undo_is_offered_only_for_a_while(qtbot, sidebar):
    sidebar.undo_timeout_ms = 20
    sidebar.request_delete(1)
    assert sidebar.pending_delete() == 1
    qtbot.waitUntil(lambda: sidebar.undo_bar.isHidden(), timeout=2000)
    assert sidebar.pending_delete() is None
    with qtbot.assertNotEmitted(sidebar.restore_requested):
        sidebar.undo_delete()
    assert sidebar.ids() == [3, 2]


def test_delete_key_deletes_the_highlighted_row(qtbot, sidebar):
    sidebar.set_current(1)
    sidebar.list.setFocus()
    with qtbot.waitSignal(sidebar.delete_requested) as deleted:
        qtbot.keyClick(sidebar.list, Qt.Key.Key_Delete)
    assert deleted.args == [1] and sidebar.ids() == [3, 2]
    assert sidebar.list.currentItem() is None  # the deleted chat was the open one


def test_deleting_the_last_row_shows_the_empty_state(qtbot, sidebar):
    sidebar.set_conversations([ROWS[0]])
    sidebar.request_delete(3)
    assert sidebar.ids() == [] and not sidebar.empty_label.isHidden()
    sidebar.undo_delete()
    assert sidebar.ids() == [3] and sidebar.empty_label.isHidden()


def badge_pixels(sidebar: ConversationList, conversation_id: int) -> int:
    """How many pixels of the row, as drawn, have the API mark's colour."""
    item = sidebar.list.item(sidebar.ids().index(conversation_id))
    rect = sidebar.list.visualItemRect(item)
    image = sidebar.list.viewport().grab(rect).toImage()
    return sum(
        image.pixelColor(x, y).rgb() == BADGE_COLOR.rgb()
        for x in range(image.width())
        for y in range(image.height())
    )


def test_an_api_conversation_wears_a_mark_with_its_client(qtbot, sidebar):
    agent = "OpenAI/Python 1.99.0"
    sidebar.set_conversations(
        [ConversationRow(4, f"API · {agent} · Write a haiku", 1_700_000_400.0), *ROWS]
    )
    item = sidebar.list.item(0)
    assert item.text() == f"API · {agent} · Write a haiku"  # the title itself is unchanged
    assert not item.icon().isNull() and item.data(CLIENT_ROLE) == agent
    assert item.toolTip().startswith(f"Asked through the API by {agent}\n")
    typed = sidebar.list.item(1)
    assert typed.icon().isNull() and typed.data(CLIENT_ROLE) is None
    assert "API" not in typed.toolTip()
    # drawn: the mark's colour is in the API row and nowhere in a typed one
    qtbot.waitUntil(lambda: badge_pixels(sidebar, 4) > 50)
    assert badge_pixels(sidebar, 3) == 0


def test_api_client_reads_the_title():
    assert api_client("API · curl/8.5 · hi · there") == "curl/8.5"
    assert api_client("API · unknown client · hi") == "unknown client"
    assert api_client("Apiary notes") is None and api_client("Newest") is None
