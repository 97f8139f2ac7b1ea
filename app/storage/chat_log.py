"""A terminal chat kept in the conversation store, message by message, as the window keeps it
(the rules are app.storage.recorder's: a conversation per first message, each reply begun at
prefill, saved about once a second while it streams and completed with its stats).

A store that fails mid-chat (locked for too long, disk full) costs the record, not the chat:
one line on stderr, and the chat goes on unsaved.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app import paths
from app.storage.recorder import ConversationRecorder
from app.storage.store import CANNOT_OPEN, ConversationStore, settings_to_dict
from engine.events import Event
from engine.settings import GenerationSettings


def warn(text: str) -> None:
    print(f"glassbox chat: {text}", file=sys.stderr, flush=True)


def open_store(
    path: Path | None = None, report: Callable[[str], None] = warn
) -> ConversationStore | None:
    """The store (default: the window's), or None, said on stderr, when it cannot be opened.

    Deleted conversations are left alone: the window may still offer to undo a deletion.
    """
    try:
        store = ConversationStore(path or paths.database_path(), purge=False)
    except CANNOT_OPEN as error:
        report(f"cannot open the conversation database ({error}); this chat is not saved")
        return None
    if store.recovered_from is not None:
        report(
            f"the conversation database was damaged ({store.recovery_reason}); it was kept"
            f" aside as {store.recovered_from} and a new one started"
        )
    return store


class ChatLog:
    """Records one terminal chat; with `store=None` every call does nothing (`--no-store`)."""

    def __init__(
        self,
        store: ConversationStore | None,
        model: str,
        system_prompt: str,
        settings: GenerationSettings,
        report: Callable[[str], None] = warn,
    ) -> None:
        self.model = model
        self.system_prompt = system_prompt
        self.settings = settings_to_dict(settings)
        self._recorder = ConversationRecorder(store) if store is not None else None
        self._report = report

    @property
    def store(self) -> ConversationStore | None:
        return self._recorder.store if self._recorder is not None else None

    @property
    def conversation_id(self) -> int | None:
        return self._recorder.conversation_id if self._recorder is not None else None

    def user(self, text: str) -> None:
        """Commit a user message, starting the conversation with the first one."""
        if self._recorder is not None:
            self._safely(
                self._recorder.add_user,
                text, model=self.model, system_prompt=self.system_prompt, settings=self.settings,
            )  # fmt: skip

    def record(self, event: Event) -> None:
        """Follow the reply: begun at prefill, saved as it streams, completed when it ends."""
        if self._recorder is not None:
            self._safely(self._recorder.record, event, model=self.model, settings=self.settings)

    def interrupted(self) -> None:
        """Save what streamed so far now; the reply stays incomplete."""
        if self._recorder is not None:
            self._safely(self._recorder.interrupted)

    def new_conversation(self) -> None:
        """The next message starts another conversation (the terminal's /new)."""
        if self._recorder is not None:
            self._safely(self._recorder.open, None)

    def close(self) -> None:
        self.interrupted()
        if self._recorder is not None:
            self._recorder.store.close()
            self._recorder = None

    def _safely(self, call: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Call the recorder; a store error stops the saving, not the chat."""
        try:
            call(*args, **kwargs)
        except sqlite3.Error as error:
            self._report(f"saving this chat failed ({error}); it goes on unsaved")
            if self._recorder is not None:
                self._recorder.store.close()
            self._recorder = None
