"""The sidebar of past conversations: a search field, a "New chat" button and the list.

The widget holds no data of its own beyond the rows it is given (`set_conversations`) and asks
for everything through signals; the app owns the store. Deleting hides the row at once and
offers Undo for a few seconds (`restore_requested`), rather than asking for confirmation.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from PySide6.QtCore import QEvent, QObject, QPoint, QRectF, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QFont, QIcon, QKeyEvent, QPainter, QPixmap
from PySide6.QtWidgets import (
    QAbstractItemView,
    QFrame,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

ID_ROLE = Qt.ItemDataRole.UserRole
TITLE_ROLE = Qt.ItemDataRole.UserRole + 1
UPDATED_ROLE = Qt.ItemDataRole.UserRole + 2
CLIENT_ROLE = Qt.ItemDataRole.UserRole + 3  # an API conversation's client (its User-Agent)
SEARCH_DELAY_MS = 250
UNDO_TIMEOUT_MS = 8000
API_MARK = "API"  # a title's first word for a conversation that came through the API


@dataclass(frozen=True, slots=True)
class ConversationRow:
    """What the list shows of one conversation. `updated` is Unix seconds."""

    id: int
    title: str
    updated: float


def is_api_title(title: str) -> bool:
    return title.startswith(f"{API_MARK} · ")


def api_client(title: str) -> str | None:
    """The client named in an API conversation's title ("API · <client> · <first message>");
    None for a conversation typed in the window."""
    if not is_api_title(title):
        return None
    return title.split(" · ")[1] if title.count(" · ") >= 2 else ""


BADGE_SIZE = QSize(30, 16)  # logical pixels: room for the mark's three letters
BADGE_COLOR = QColor("#2f6fbf")


def api_badge(ratio: float = 2.0) -> QIcon:
    """The mark drawn before an API conversation's title: "API" in a small rounded tag."""
    pixmap = QPixmap(BADGE_SIZE * ratio)
    pixmap.setDevicePixelRatio(ratio)
    pixmap.fill(Qt.GlobalColor.transparent)
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    rect = QRectF(0.5, 1.5, BADGE_SIZE.width() - 1, BADGE_SIZE.height() - 3)
    painter.setPen(Qt.PenStyle.NoPen)
    painter.setBrush(BADGE_COLOR)
    painter.drawRoundedRect(rect, 4, 4)
    font = QFont()
    font.setPixelSize(10)
    font.setBold(True)
    painter.setFont(font)
    painter.setPen(QColor("white"))
    painter.drawText(rect, Qt.AlignmentFlag.AlignCenter, API_MARK)
    painter.end()
    return QIcon(pixmap)


def _one_line(text: str) -> str:
    return " ".join(text.split())


class ConversationList(QWidget):
    """Past conversations, newest first, with search, rename, delete (with undo) and export."""

    open_requested = Signal(int)
    new_requested = Signal()
    rename_requested = Signal(int, str)
    delete_requested = Signal(int)
    # Undo of a deletion: the app restores the conversation and refreshes the list.
    restore_requested = Signal(int)
    # format: "md" or "json"; the app asks where to save.
    export_requested = Signal(int, str)
    # The search text after typing pauses (empty: show all); the app answers with
    # set_conversations(matching rows).
    search_changed = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.undo_timeout_ms = UNDO_TIMEOUT_MS
        self._open_id: int | None = None
        self._pending_delete: tuple[int, int, ConversationRow] | None = None  # id, row, data
        self._items: dict[int, QListWidgetItem] = {}  # the rows shown, by conversation id
        self._updating = False

        self.search_field = QLineEdit(placeholderText="Search conversations")
        self.search_field.setClearButtonEnabled(True)
        self.new_button = QPushButton("New chat")
        self.new_button.setToolTip("Start a new conversation")
        self.list = QListWidget()
        self.list.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        self.list.setEditTriggers(QAbstractItemView.EditTrigger.EditKeyPressed)
        self.list.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.list.setUniformItemSizes(True)
        self.list.setIconSize(BADGE_SIZE)
        self._badge = api_badge(self.devicePixelRatioF())
        self.empty_label = QLabel("No conversations yet", alignment=Qt.AlignmentFlag.AlignCenter)
        self.empty_label.setEnabled(False)  # drawn greyed out
        self.undo_bar, self.undo_label, self.undo_button = self._build_undo_bar()

        top = QHBoxLayout()
        top.setContentsMargins(0, 0, 0, 0)
        top.addWidget(self.search_field, 1)
        top.addWidget(self.new_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(top)
        layout.addWidget(self.list, 1)
        layout.addWidget(self.empty_label, 1)
        layout.addWidget(self.undo_bar)

        self._search_timer = QTimer(self, singleShot=True, interval=SEARCH_DELAY_MS)
        self._search_timer.timeout.connect(self._emit_search)
        self._undo_timer = QTimer(self, singleShot=True)
        self._undo_timer.timeout.connect(self._end_undo)

        self.search_field.textChanged.connect(self._search_timer.start)
        self.search_field.returnPressed.connect(self._emit_search)
        self.new_button.clicked.connect(self.new_requested)
        self.list.itemClicked.connect(self._request_open)
        self.list.itemActivated.connect(self._request_open)
        self.list.itemChanged.connect(self._title_edited)
        self.list.customContextMenuRequested.connect(self._show_menu)
        self.list.installEventFilter(self)
        self.undo_button.clicked.connect(self.undo_delete)
        self._update_empty_state()

    def _build_undo_bar(self) -> tuple[QFrame, QLabel, QPushButton]:
        bar = QFrame()
        bar.setFrameShape(QFrame.Shape.StyledPanel)
        label = QLabel()
        button = QPushButton("Undo")
        row = QHBoxLayout(bar)
        row.setContentsMargins(6, 2, 2, 2)
        row.addWidget(label, 1)
        row.addWidget(button)
        bar.hide()
        return bar, label, button

    # -- what the app calls ----------------------------------------------------------------

    def set_conversations(self, rows: Iterable[ConversationRow]) -> None:
        """Show these rows in this order; the open conversation stays highlighted."""
        self._updating = True
        try:
            self.list.clear()
            self._items.clear()
            for row in rows:
                if self._pending_delete and row.id == self._pending_delete[0]:
                    continue  # still hidden while its deletion can be undone
                self._insert(self.list.count(), row)
        finally:
            self._updating = False
        self._select(self._open_id)
        self._update_empty_state()

    def place(self, row: ConversationRow) -> None:
        """Show `row` where its recency puts it among the rows shown (newest first: updated,
        then id, as the store orders them), in place of its old row; the others stay as
        they are."""
        if self._pending_delete and row.id == self._pending_delete[0]:
            return
        self._updating = True
        try:
            old = self._items.pop(row.id, None)
            if old is not None:
                self.list.takeItem(self.list.row(old))
            index, newer = 0, (row.updated, row.id)
            while index < self.list.count():
                item = self.list.item(index)
                if (item.data(UPDATED_ROLE), item.data(ID_ROLE)) < newer:
                    break
                index += 1
            self._insert(index, row)
        finally:
            self._updating = False
        self._select(self._open_id)
        self._update_empty_state()

    def set_current(self, conversation_id: int | None) -> None:
        """Mark the conversation that is open (None: a new, unsaved chat). Emits nothing."""
        self._open_id = conversation_id
        self._select(conversation_id)

    def current_id(self) -> int | None:
        return self._open_id

    def ids(self) -> list[int]:
        """The ids shown, top to bottom."""
        return [self.list.item(i).data(ID_ROLE) for i in range(self.list.count())]

    def search_text(self) -> str:
        return self.search_field.text().strip()

    def focus_search(self) -> None:
        self.search_field.setFocus()
        self.search_field.selectAll()

    # -- actions ---------------------------------------------------------------------------

    def start_rename(self, conversation_id: int) -> None:
        """Edit the title in place; Enter emits rename_requested, Escape cancels."""
        item = self._item(conversation_id)
        if item is not None:
            self.list.scrollToItem(item)
            self.list.editItem(item)

    def request_delete(self, conversation_id: int) -> None:
        """Hide the row, emit delete_requested and offer Undo for `undo_timeout_ms`."""
        item = self._item(conversation_id)
        if item is None:
            return
        row = ConversationRow(conversation_id, item.data(TITLE_ROLE), item.data(UPDATED_ROLE))
        index = self.list.row(item)
        self._updating = True
        try:
            self.list.takeItem(index)
            del self._items[conversation_id]
        finally:
            self._updating = False
        self._select(self._open_id)
        self._pending_delete = (conversation_id, index, row)
        self.undo_label.setText(f"Deleted “{row.title}”")
        self.undo_bar.show()
        self._undo_timer.start(self.undo_timeout_ms)
        self._update_empty_state()
        self.delete_requested.emit(conversation_id)

    def undo_delete(self) -> None:
        """Bring back the row deleted last and emit restore_requested."""
        if self._pending_delete is None:
            return
        conversation_id, index, row = self._pending_delete
        self._end_undo()
        self._updating = True
        try:
            self._insert(min(index, self.list.count()), row)
        finally:
            self._updating = False
        self._select(self._open_id)
        self._update_empty_state()
        self.restore_requested.emit(conversation_id)

    def pending_delete(self) -> int | None:
        """The id whose deletion can still be undone."""
        return self._pending_delete[0] if self._pending_delete else None

    def menu_for(self, conversation_id: int) -> QMenu:
        """The context menu of one row (built fresh each time)."""
        menu = QMenu(self)
        menu.addAction("Open", lambda: self._request_open_id(conversation_id))
        menu.addAction("Rename", lambda: self.start_rename(conversation_id))
        export = menu.addMenu("Export")
        export.addAction("Markdown…", lambda: self.export_requested.emit(conversation_id, "md"))
        export.addAction("JSON…", lambda: self.export_requested.emit(conversation_id, "json"))
        menu.addSeparator()
        menu.addAction("Delete", lambda: self.request_delete(conversation_id))
        return menu

    # -- internals -------------------------------------------------------------------------

    def _make_item(self, row: ConversationRow) -> QListWidgetItem:
        title = _one_line(row.title) or "Untitled"
        item = QListWidgetItem(title)
        item.setData(ID_ROLE, row.id)
        item.setData(TITLE_ROLE, title)
        item.setData(UPDATED_ROLE, row.updated)
        when = datetime.fromtimestamp(row.updated).strftime("%Y-%m-%d %H:%M")
        item.setToolTip(f"{title}\nUpdated {when}")
        client = api_client(title)
        if client is not None:  # told apart at a glance from the chats typed here
            font = item.font()
            font.setItalic(True)
            item.setFont(font)
            item.setIcon(self._badge)
            item.setData(CLIENT_ROLE, client)
            asker = client or "an unknown client"
            item.setToolTip(f"Asked through the API by {asker}\n{title}\nUpdated {when}")
        item.setFlags(item.flags() | Qt.ItemFlag.ItemIsEditable)
        return item

    def _insert(self, index: int, row: ConversationRow) -> None:
        item = self._make_item(row)
        self.list.insertItem(index, item)
        self._items[row.id] = item

    def _item(self, conversation_id: int | None) -> QListWidgetItem | None:
        return None if conversation_id is None else self._items.get(conversation_id)

    def _select(self, conversation_id: int | None) -> None:
        """Highlight a row without emitting anything (selection mirrors the open chat)."""
        self._updating = True
        try:
            item = self._item(conversation_id)
            if item is None:
                self.list.clearSelection()
                self.list.setCurrentRow(-1)
            else:
                self.list.setCurrentItem(item)
        finally:
            self._updating = False

    def _request_open(self, item: QListWidgetItem) -> None:
        self._request_open_id(item.data(ID_ROLE))

    def _request_open_id(self, conversation_id: int) -> None:
        # A double click is a click and an activation: ask once.
        if conversation_id != self._open_id:
            self.open_requested.emit(conversation_id)

    def _title_edited(self, item: QListWidgetItem) -> None:
        if self._updating:
            return
        old = item.data(TITLE_ROLE)
        new = _one_line(item.text())
        self._updating = True
        try:
            item.setText(new or old)
            if new and new != old:
                item.setData(TITLE_ROLE, new)
        finally:
            self._updating = False
        if new and new != old:
            self.rename_requested.emit(item.data(ID_ROLE), new)

    def _show_menu(self, pos: QPoint) -> None:
        item = self.list.itemAt(pos)
        if item is None:
            return
        menu = self.menu_for(item.data(ID_ROLE))
        menu.exec(self.list.viewport().mapToGlobal(pos))
        menu.deleteLater()
        self._select(self._open_id)  # a right click moved the highlight

    def _emit_search(self) -> None:
        self._search_timer.stop()
        self.search_changed.emit(self.search_text())

    def _end_undo(self) -> None:
        self._undo_timer.stop()
        self._pending_delete = None
        self.undo_bar.hide()

    def _update_empty_state(self) -> None:
        empty = self.list.count() == 0
        self.empty_label.setText("No matches" if self.search_text() else "No conversations yet")
        self.empty_label.setVisible(empty)
        self.list.setVisible(not empty)

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        # Delete on the list deletes the highlighted row (not while its title is being edited).
        if (
            watched is self.list
            and event.type() == QEvent.Type.KeyPress
            and isinstance(event, QKeyEvent)
            and event.key() == Qt.Key.Key_Delete
            and self.list.currentItem() is not None
            and self.list.state() != QAbstractItemView.State.EditingState
        ):
            self.request_delete(self.list.currentItem().data(ID_ROLE))
            return True
        return super().eventFilter(watched, event)
