"""Keep the conversation store in step with the window: every message saved, nothing lost.

The window's conversation (ui.conversation) announces each change; this controller writes it
through app.storage.recorder, the rules the terminal chat follows too: a conversation created with
its first message, each user message committed, a reply saved while it streams (about once a
second, marked incomplete) and completed with its stats, so a crash loses at most the last
second and never a finished message. A reply cut off with its engine stays incomplete.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from PySide6.QtCore import QObject
from PySide6.QtWidgets import QFileDialog, QMessageBox

from app.storage.export import export_conversation, suggested_filename
from app.storage.recorder import ConversationRecorder, title_from
from app.storage.store import ConversationStore, StoredMessage
from engine.settings import GenerationSettings, Message
from ui.conversation import (
    Added,
    Change,
    Entry,
    ReplyAbandoned,
    ReplyEnded,
    ReplyEvent,
    ReplyTokens,
    Reset,
    Truncated,
)
from ui.conversation_list import API_MARK, ConversationList, ConversationRow
from ui.main_window import MainWindow

log = logging.getLogger(__name__)


def api_title(client: str, first_message: str) -> str:
    """An API conversation's title: marked as such, with who sent it and what it asked."""
    return f"{API_MARK} · {client or 'unknown client'} · {title_from(first_message)}"


def entry_of(message: StoredMessage) -> Entry:
    """A stored message as the conversation holds it."""
    return Entry(
        message.role, message.text, message.model, stats=message.stats,
        complete=message.complete, confidence=message.confidence,
    )  # fmt: skip


class ConversationController(QObject):
    def __init__(
        self, window: MainWindow, store: ConversationStore, sidebar: ConversationList
    ) -> None:
        super().__init__(window)
        self.window, self.store, self.sidebar = window, store, sidebar
        # The window keeps a reply that never reached the model (refused) as an empty message.
        self.recorder = ConversationRecorder(store, keep_unanswered=True)
        window.conversation_model.subscribe(self._on_change)
        sidebar.open_requested.connect(self.open)
        sidebar.new_requested.connect(window.new_chat)
        sidebar.rename_requested.connect(self._rename)
        sidebar.delete_requested.connect(self._delete)
        sidebar.restore_requested.connect(self._restore)
        sidebar.export_requested.connect(self._export)
        sidebar.search_changed.connect(lambda _: self.refresh())
        window.settings_panel.completion_toggled.connect(self._set_completion)
        self.refresh()

    @property
    def conversation_id(self) -> int | None:
        """The open conversation's id in the store (None until its first message)."""
        return self.recorder.conversation_id

    # -- opening ------------------------------------------------------------------------------

    def reopen_last(self) -> None:
        last = self.store.last_opened()
        if last is not None and self.store.conversation(last) is not None:
            self.open(last)

    def open(self, conversation_id: int, keep_cache: bool = False) -> None:
        conversation = self.store.conversation(conversation_id)
        if conversation is None:
            return
        entries = [entry_of(m) for m in self.store.messages(conversation_id)]
        # The window's Reset of the conversation resets the recorder too.
        self.window.set_conversation(entries, conversation.system_prompt, keep_cache)
        self.window.settings_panel.set_completion(conversation.completion)
        self.recorder.open(conversation_id)
        self.store.set_last_opened(conversation_id)
        self.sidebar.set_current(conversation_id)

    def open_api(
        self, messages: Sequence[Message], settings: GenerationSettings, client: str
    ) -> None:
        """A conversation of its own for a request that came through the API, opened in the
        window: titled for the client that sent it (its User-Agent), holding its messages.
        The engine keeps its KV cache: a client resending a conversation that grew by a turn
        (as agents do) is prefilled from where the cache ends, as by `glassbox serve`."""
        system = messages[0].content if messages and messages[0].role == "system" else ""
        turns = messages[1:] if system else messages
        first = next((m.content for m in turns if m.role == "user"), "")
        model = self.window.info.name if self.window.info is not None else None
        conversation_id = self.store.create_conversation(
            api_title(client, first),
            model=model,
            system_prompt=system,
            settings=settings,
            completion=settings.completion,
        )
        for message in turns:
            self.store.add_message(
                conversation_id, message.role, message.content, model=model, settings=settings
            )
        self.open(conversation_id, keep_cache=True)
        self.window.conversation_model.system_prompt = system  # the request's, even if none
        self.refresh()

    # -- saving -------------------------------------------------------------------------------

    def _on_change(self, change: Change) -> None:
        """Write what the conversation says happened, as it happens."""
        if isinstance(change, Reset):  # a new chat: the next message starts a new conversation
            self.recorder.open(None)
            self.sidebar.set_current(None)
        elif isinstance(change, Added):
            self._add_user(change.entry)
        elif isinstance(change, Truncated):  # the last reply is regenerated
            self.recorder.truncate(len(change.entries))
        elif isinstance(change, ReplyTokens):  # tokens delivered together: saved as one piece
            self.recorder.record_tokens(change.tokens, change.confidences)
        elif isinstance(change, ReplyEvent):
            reply = change.reply
            self.recorder.record(change.event, model=reply.model, settings=reply.settings)
        elif isinstance(change, ReplyEnded):
            self._show_updated()
        elif isinstance(change, ReplyAbandoned):
            self.recorder.interrupted()

    def _add_user(self, entry: Entry) -> None:
        new = self.conversation_id is None
        system_prompt = self.window.conversation_model.system_prompt
        self.recorder.add_user(
            entry.text, model=entry.model, system_prompt=system_prompt, settings=entry.settings
        )
        if new:
            self.store.set_last_opened(self.conversation_id)
        self._show_updated()

    def flush(self) -> None:
        """Save the streaming reply's text now (quitting or switching mid-reply)."""
        self.recorder.interrupted()

    def close(self) -> None:
        self.flush()
        self.store.close()

    # -- the sidebar --------------------------------------------------------------------------

    def _show_updated(self) -> None:
        """The open conversation was just written: its row alone moves to the top (building
        the whole list again costs in proportion to the history, at every message and every
        reply's end). A search in progress is run again: the conversation may match it now."""
        conversation_id = self.conversation_id
        found = None if conversation_id is None else self.store.conversation(conversation_id)
        if self.sidebar.search_text() or found is None or found.deleted is not None:
            self.refresh()
            return
        self.sidebar.place(ConversationRow(found.id, found.title, found.updated))
        self.sidebar.set_current(conversation_id)

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
