"""Keep the conversation store in step with the window: every message saved, nothing lost.

The window owns the conversation being shown; this controller mirrors it into SQLite. A reply
is saved while it streams (about once a second, marked incomplete) and completed with its
stats when it finishes, so a crash loses at most the last second and never a finished message.
A reply cut off because the engine process died stays stored incomplete, with what streamed.
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.export import export_conversation, suggested_filename
from app.jobs import ENGINE_STOPPED
from app.store import ConversationStore, ReplySaver, settings_to_dict, stats_from_finished
from engine.events import Failed, Finished, PrefillDone, Token
from engine.settings import Message
from ui.conversation_list import ConversationList, ConversationRow
from ui.main_window import MainWindow

log = logging.getLogger(__name__)
TITLE_CHARS = 48


class ConversationController(QObject):
    def __init__(
        self, window: MainWindow, store: ConversationStore, sidebar: ConversationList
    ) -> None:
        super().__init__(window)
        self.window, self.store, self.sidebar = window, store, sidebar
        self.conversation_id: int | None = None
        self._saver: ReplySaver | None = None
        self._engine_stopped = False  # the streaming reply was cut off with its engine
        self._saved: list[Message] = []  # what the store holds for the open conversation
        window.conversation_changed.connect(self.sync)
        window.event_received.connect(self._on_event)
        sidebar.open_requested.connect(self.open)
        sidebar.new_requested.connect(window.new_chat)
        sidebar.rename_requested.connect(self._rename)
        sidebar.delete_requested.connect(self._delete)
        sidebar.restore_requested.connect(self._restore)
        sidebar.export_requested.connect(self._export)
        sidebar.search_changed.connect(lambda _: self.refresh())
        window.settings_panel.completion_toggled.connect(self._set_completion)
        self.refresh()

    # -- opening ------------------------------------------------------------------------------

    def reopen_last(self) -> None:
        last = self.store.last_opened()
        if last is not None and self.store.conversation(last) is not None:
            self.open(last)

    def open(self, conversation_id: int) -> None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return
        self.flush()
        stored = [m.as_message() for m in self.store.messages(conversation_id)]
        system = (
            [Message("system", conversation.system_prompt)] if conversation.system_prompt else []
        )
        self.conversation_id = None  # set_conversation's change signal must not write anything
        self.window.set_conversation([*system, *stored])
        self.window.settings_panel.set_completion(conversation.completion)
        self.conversation_id, self._saved = conversation_id, stored
        self.store.set_last_opened(conversation_id)
        self.sidebar.set_current(conversation_id)

    # -- saving -------------------------------------------------------------------------------

    def sync(self) -> None:
        """Write what changed: messages past the first difference are replaced."""
        shown = self.window.conversation()
        if not shown:  # a new chat: the next message starts a new conversation
            self.flush()
            self.conversation_id, self._saved = None, []
            self.sidebar.set_current(None)
            return
        if self.conversation_id is None:
            self._create(shown[0].content)
        same = 0
        while same < min(len(shown), len(self._saved)) and shown[same] == self._saved[same]:
            same += 1
        if same < len(self._saved):
            self.store.truncate(self.conversation_id, same)  # regenerate or edit
        model = self.window.info.name if self.window.info else None
        settings = settings_to_dict(self.window.settings_panel.settings())
        for message in shown[same:]:
            self.store.add_message(
                self.conversation_id, message.role, message.content, model=model, settings=settings
            )
        self._saved = list(shown)
        self.refresh()

    def _on_event(self, event: object) -> None:
        if not self.window.replying or self.conversation_id is None:
            return
        if isinstance(event, PrefillDone):
            model = self.window.info.name if self.window.info else None
            settings = self.window.settings_panel.settings()
            reply = self.store.begin_reply(self.conversation_id, model, settings)
            self._saver = ReplySaver(self.store, reply)
            self._engine_stopped = False
        elif isinstance(event, Token) and self._saver:
            self._saver.append(event.text)
        elif isinstance(event, Failed) and event.error_type == ENGINE_STOPPED:
            self._engine_stopped = True
        elif isinstance(event, Finished) and self._saver:
            if self._engine_stopped:  # kept as on a crash: the text so far, incomplete
                self._saver.set_text(event.text)
                self._saver.flush()
            else:
                self._saver.finish(stats_from_finished(event), event.text)
            self._saver, self._engine_stopped = None, False
            self._saved.append(Message("assistant", event.text))  # now stored

    def flush(self) -> None:
        """Save the streaming reply's text now (quitting or switching mid-reply)."""
        if self._saver is not None:
            self._saver.flush()
            self._saver = None

    def close(self) -> None:
        self.flush()
        self.store.close()

    def _create(self, first_message: str) -> None:
        title = " ".join(first_message.split())[:TITLE_CHARS] or "New chat"
        self.conversation_id = self.store.create_conversation(
            title,
            model=self.window.info.name if self.window.info else None,
            system_prompt=self.window.settings_panel.system_prompt(),
            settings=self.window.settings_panel.settings(),
        )
        self._saved = []
        self.store.set_last_opened(self.conversation_id)

    # -- the sidebar --------------------------------------------------------------------------

    def refresh(self) -> None:
        query = self.sidebar.search_text()
        found = self.store.search(query) if query else self.store.list_conversations()
        self.sidebar.set_conversations([ConversationRow(c.id, c.title, c.updated) for c in found])
        self.sidebar.set_current(self.conversation_id)

    def _rename(self, conversation_id: int, title: str) -> None:
        try:
            self.store.rename(conversation_id, title)
        except (KeyError, ValueError) as error:
            self.window.show_status(f"Could not rename: {error}")
        self.refresh()

    def _delete(self, conversation_id: int) -> None:
        self.store.delete(conversation_id)
        if conversation_id == self.conversation_id:
            self.window.new_chat()
        self.refresh()

    def _set_completion(self, on: bool) -> None:
        """The open conversation keeps the mode the user switched it to (a new one takes the
        switch's state when it is created, with the settings)."""
        if self.conversation_id is not None:
            self.store.update_conversation(self.conversation_id, completion=on)

    def _restore(self, conversation_id: int) -> None:
        self.store.restore(conversation_id)
        self.refresh()

    def _export(self, conversation_id: int, fmt: str) -> None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return
        default = str(Path.home() / suggested_filename(conversation, fmt))
        path, _ = QFileDialog.getSaveFileName(self.window, "Export conversation", default)
        if not path:
            return
        try:
            written = export_conversation(self.store, conversation_id, fmt, Path(path))
        except OSError as error:
            QMessageBox.warning(self.window, "Export failed", f"Could not write {path}: {error}")
            return
        self.window.show_status(f"Exported to {written}")
