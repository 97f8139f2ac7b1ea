"""A terminal chat kept in the conversation store, message by message, as the window keeps it.

The conversation is created with its first message (titled from it, with the model, system
prompt and settings). Each user message is committed before its reply starts; the reply is
saved about once a second while it streams, marked incomplete, and completed with its stats
when it ends. A process killed mid-reply loses at most the last second of that reply.

A store that fails mid-chat (locked for too long, disk full) costs the record, not the chat:
one line on stderr, and the chat goes on unsaved.
"""

from __future__ import annotations

import sqlite3
import sys
from collections.abc import Callable
from pathlib import Path

from app import paths
from app.store import ConversationStore, ReplySaver, settings_to_dict, stats_from_finished
from engine.events import Event, Finished, PrefillDone, Token
from engine.settings import GenerationSettings

TITLE_CHARS = 48  # as the window titles a conversation from its first message


def title_from(first_message: str) -> str:
    return " ".join(first_message.split())[:TITLE_CHARS]


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
    except (OSError, sqlite3.Error) as error:
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
        self.store = store
        self.model = model
        self.system_prompt = system_prompt
        self.settings = settings_to_dict(settings)
        self.conversation_id: int | None = None
        self._report = report
        self._saver: ReplySaver | None = None

    def user(self, text: str) -> None:
        """Commit a user message, starting the conversation with the first one."""
        self._safely(self._add_user, text)

    def record(self, event: Event) -> None:
        """Follow the reply: begun at prefill, saved as it streams, completed when it ends."""
        self._safely(self._record, event)

    def interrupted(self) -> None:
        """Save what streamed so far now; the reply stays incomplete."""
        saver, self._saver = self._saver, None
        if saver is not None:
            self._safely(saver.flush)

    def new_conversation(self) -> None:
        """The next message starts another conversation (the terminal's /new)."""
        self.interrupted()
        self.conversation_id = None

    def close(self) -> None:
        self.interrupted()
        if self.store is not None:
            self.store.close()
            self.store = None

    def _add_user(self, text: str) -> None:
        if self.conversation_id is None:
            self.conversation_id = self.store.create_conversation(
                title_from(text),
                model=self.model,
                system_prompt=self.system_prompt,
                settings=self.settings,
            )
        self.store.add_message(
            self.conversation_id, "user", text, model=self.model, settings=self.settings
        )

    def _record(self, event: Event) -> None:
        if isinstance(event, PrefillDone) and self.conversation_id is not None:
            reply = self.store.begin_reply(self.conversation_id, self.model, self.settings)
            self._saver = ReplySaver(self.store, reply)
        elif isinstance(event, Token) and self._saver is not None:
            self._saver.append(event.text)
        elif isinstance(event, Finished) and self._saver is not None:
            saver, self._saver = self._saver, None
            saver.finish(stats_from_finished(event), event.text)

    def _safely(self, action: Callable[..., object], *args: object) -> None:
        if self.store is None:
            return
        try:
            action(*args)
        except sqlite3.Error as error:
            self._report(f"saving this chat failed ({error}); it goes on unsaved")
            self._saver = None
            self.store.close()
            self.store = None
