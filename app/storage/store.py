"""The conversation store: every chat and message in one SQLite file.

SQLite in WAL mode, one short transaction per write, so a crash or a kill at any moment leaves a
readable database: finished messages are whole, and a reply that was streaming stays marked
incomplete with the text saved last. `ReplySaver` throttles those partial saves.

The file's schema, its migrations and what happens to a file that cannot serve are in
app/storage/schema.py (a damaged one is moved aside and a fresh one started; `recovered_from`
tells the app); the stored records and their rows in app/storage/records.py.

Threads: a store belongs to the thread that opened it (the GUI thread). sqlite3's default
`check_same_thread=True` is kept, so use from another thread fails loudly instead of racing.
Another process (the CLI) may open the same file at the same time; writers wait up to
`BUSY_TIMEOUT_S` for each other.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from app.storage.records import (
    StoredConversation,
    StoredMessage,
    conversation_from_row,
    dumps,
    generation_settings,
    message_from_row,
    settings_to_dict,
    value_text,
)
from app.storage.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    NewerDatabase,
    UnusableDatabase,
    open_database,
    set_aside,
)
from engine.settings import GenerationSettings

__all__ = [
    "CANNOT_OPEN",
    "DEFAULT_TITLE",
    "IN_MEMORY",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "ConversationStore",
    "NewerDatabase",
    "ReplySaver",
    "StoredConversation",
    "StoredMessage",
    "UnusableDatabase",
    "generation_settings",
    "set_aside",
    "settings_to_dict",
]

ROLES = frozenset({"system", "user", "assistant"})
DEFAULT_TITLE = "New chat"
IN_MEMORY = ":memory:"  # a store's path that is no file: kept until the store is closed
# What opening a store raises where its file cannot serve at all (a folder that cannot be
# made, a file SQLite cannot open, a newer Glassbox's file): the caller runs without it
CANNOT_OPEN = (OSError, sqlite3.Error, NewerDatabase)
LAST_OPENED_KEY = "last_opened_conversation"


class ConversationStore:
    """Conversations and messages in one SQLite file. Use from one thread (see module doc)."""

    def __init__(
        self, path: Path | str, *, clock: Callable[[], float] = time.time, purge: bool = True
    ) -> None:
        """Open (or create) the store; a damaged file is set aside, a newer Glassbox's raises
        NewerDatabase (see app.storage.schema). `purge=False` leaves deleted conversations for
        another process to restore: the terminal chat opens the file while the window may be
        running."""
        self.path = Path(path)
        self._clock = clock
        # Where a damaged file was moved, and why, when opening had to start afresh.
        self.recovered_from: Path | None = None
        self.recovery_reason: str | None = None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._conn = open_database(self.path)
        except UnusableDatabase as problem:
            self.recovered_from = set_aside(self.path, self._clock())
            self.recovery_reason = str(problem)
            self._conn = open_database(self.path)
        if purge:
            self.purge_deleted()

    @property
    def schema_version(self) -> int:
        version: int = self._conn.execute("PRAGMA user_version").fetchone()[0]
        return version

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """One transaction, committed when the block ends (IMMEDIATE: take the write lock now)."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- conversations ---------------------------------------------------------------------

    def create_conversation(
        self,
        title: str = DEFAULT_TITLE,
        *,
        model: str | None = None,
        system_prompt: str = "",
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        completion: bool | None = None,
    ) -> int:
        """A new conversation; its completion mode is `completion`, else the settings' own."""
        now = self._clock()
        values = settings_to_dict(settings)
        if completion is None:
            completion = bool(values.get("completion", False))
        with self._write() as conn:
            cursor = conn.execute(
                "INSERT INTO conversations"
                " (title, created, updated, model, system_prompt, settings, completion)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    _clean_title(title) or DEFAULT_TITLE,
                    now,
                    now,
                    model,
                    system_prompt,
                    dumps(values),
                    int(completion),
                ),
            )
        row_id = cursor.lastrowid
        assert row_id is not None  # an INSERT always sets it
        return int(row_id)

    def conversation(self, conversation_id: int) -> StoredConversation | None:
        """One conversation, deleted or not; None if there is no such id."""
        row = self._conn.execute(
            "SELECT * FROM conversations WHERE id = ?", (conversation_id,)
        ).fetchone()
        return conversation_from_row(row) if row else None

    def list_conversations(self, limit: int | None = None) -> list[StoredConversation]:
        """Live conversations, most recently updated first."""
        rows = self._conn.execute(
            "SELECT * FROM conversations WHERE deleted IS NULL"
            " ORDER BY updated DESC, id DESC LIMIT ?",
            (-1 if limit is None else limit,),
        )
        return [conversation_from_row(row) for row in rows]

    def search(self, text: str, limit: int | None = None) -> list[StoredConversation]:
        """Live conversations whose title or any message contains `text`, newest first.

        Case-insensitive for all of Unicode (str.casefold), with no wildcards to escape.
        """
        needle = text.strip().casefold()
        if not needle:
            return self.list_conversations(limit)
        rows = self._conn.execute(
            "SELECT * FROM conversations AS c WHERE c.deleted IS NULL AND ("
            " instr(casefold(c.title), :needle) > 0 OR EXISTS ("
            "  SELECT 1 FROM messages AS m"
            "  WHERE m.conversation_id = c.id AND instr(casefold(m.text), :needle) > 0))"
            " ORDER BY c.updated DESC, c.id DESC LIMIT :limit",
            {"needle": needle, "limit": -1 if limit is None else limit},
        )
        return [conversation_from_row(row) for row in rows]

    def rename(self, conversation_id: int, title: str) -> None:
        """Set a conversation's title (raises ValueError when it is blank). Not a recency bump."""
        clean = _clean_title(title)
        if not clean:
            raise ValueError("a conversation title cannot be empty")
        self._update_conversation(conversation_id, "title = ?", (clean,))

    def update_conversation(
        self,
        conversation_id: int,
        *,
        model: str | None = None,
        system_prompt: str | None = None,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        completion: bool | None = None,
    ) -> None:
        """Change the model, system prompt, settings or completion mode kept with a
        conversation (None: keep)."""
        columns: list[str] = []
        values: list[Any] = []
        for column, value in (
            ("model", model),
            ("system_prompt", system_prompt),
            ("settings", None if settings is None else dumps(settings_to_dict(settings))),
            ("completion", None if completion is None else int(completion)),
        ):
            if value is not None:
                columns.append(f"{column} = ?")
                values.append(value)
        if columns:
            self._update_conversation(conversation_id, ", ".join(columns), tuple(values))

    def delete(self, conversation_id: int) -> None:
        """Hide a conversation; `restore` brings it back until the store is next opened."""
        self._update_conversation(conversation_id, "deleted = ?", (self._clock(),))

    def restore(self, conversation_id: int) -> None:
        """Undo `delete`."""
        self._update_conversation(conversation_id, "deleted = NULL", ())

    def purge_deleted(self) -> int:
        """Remove deleted conversations for good (done on open); returns how many."""
        with self._write() as conn:
            cursor = conn.execute("DELETE FROM conversations WHERE deleted IS NOT NULL")
        return cursor.rowcount

    def _update_conversation(
        self, conversation_id: int, assignments: str, values: tuple[object, ...]
    ) -> None:
        with self._write() as conn:
            cursor = conn.execute(
                f"UPDATE conversations SET {assignments} WHERE id = ?", (*values, conversation_id)
            )
        if cursor.rowcount == 0:
            raise KeyError(f"no conversation {conversation_id}")

    # -- messages --------------------------------------------------------------------------

    def messages(self, conversation_id: int) -> list[StoredMessage]:
        """A conversation's messages in order (empty for an unknown id)."""
        rows = self._conn.execute(
            "SELECT * FROM messages WHERE conversation_id = ? ORDER BY position",
            (conversation_id,),
        )
        return [message_from_row(row) for row in rows]

    def message(self, message_id: int) -> StoredMessage | None:
        row = self._conn.execute("SELECT * FROM messages WHERE id = ?", (message_id,)).fetchone()
        return message_from_row(row) if row else None

    def add_message(
        self,
        conversation_id: int,
        role: str,
        text: str,
        *,
        model: str | None = None,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
        stats: Mapping[str, Any] | None = None,
        complete: bool = True,
    ) -> int:
        """Append a message in its own transaction; returns its id."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {sorted(ROLES)}, got {role!r}")
        now = self._clock()
        with self._write() as conn:
            if (
                conn.execute(
                    "SELECT 1 FROM conversations WHERE id = ?", (conversation_id,)
                ).fetchone()
                is None
            ):
                raise KeyError(f"no conversation {conversation_id}")
            position = conn.execute(
                "SELECT COALESCE(MAX(position), -1) + 1 FROM messages WHERE conversation_id = ?",
                (conversation_id,),
            ).fetchone()[0]
            cursor = conn.execute(
                "INSERT INTO messages (conversation_id, position, role, text, created, model,"
                " settings, complete, stats) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    conversation_id,
                    position,
                    role,
                    text,
                    now,
                    model,
                    dumps(settings_to_dict(settings)),
                    int(complete),
                    dumps(stats or {}),
                ),
            )
            conn.execute(
                "UPDATE conversations SET updated = ? WHERE id = ?", (now, conversation_id)
            )
        row_id = cursor.lastrowid
        assert row_id is not None  # an INSERT always sets it
        return int(row_id)

    def begin_reply(
        self,
        conversation_id: int,
        model: str | None,
        settings: GenerationSettings | Mapping[str, Any] | None = None,
    ) -> int:
        """Insert an empty, incomplete assistant message for a reply about to stream."""
        return self.add_message(
            conversation_id, "assistant", "", model=model, settings=settings, complete=False
        )

    def update_reply(self, message_id: int, text: str) -> None:
        """Save a streaming reply's text so far; it stays incomplete. See ReplySaver."""
        with self._write() as conn:
            cursor = conn.execute(
                "UPDATE messages SET text = ? WHERE id = ? AND complete = 0", (text, message_id)
            )
            if cursor.rowcount == 0:
                self._explain_missing_reply(conn, message_id)

    def finish_reply(
        self,
        message_id: int,
        text: str,
        stats: Mapping[str, Any],
        confidence: Sequence[Any] | JsonArray = (),
    ) -> None:
        """Store a reply's final text, numbers and token confidences and mark it complete, in
        one transaction."""
        now = self._clock()
        if isinstance(confidence, JsonArray):
            encoded = confidence.dumps()
        else:
            encoded = json.dumps(list(confidence))
        with self._write() as conn:
            cursor = conn.execute(
                "UPDATE messages SET text = ?, stats = ?, confidence = ?, complete = 1"
                " WHERE id = ? AND complete = 0",
                (text, dumps(stats), encoded, message_id),
            )
            if cursor.rowcount == 0:
                self._explain_missing_reply(conn, message_id)
            conn.execute(
                "UPDATE conversations SET updated = ? WHERE id ="
                " (SELECT conversation_id FROM messages WHERE id = ?)",
                (now, message_id),
            )

    @staticmethod
    def _explain_missing_reply(conn: sqlite3.Connection, message_id: int) -> None:
        if conn.execute("SELECT 1 FROM messages WHERE id = ?", (message_id,)).fetchone():
            raise ValueError(f"message {message_id} is already finished")
        raise KeyError(f"no message {message_id}")

    def truncate(self, conversation_id: int, position: int) -> int:
        """Remove the messages at `position` and after (to regenerate or edit); returns how many."""
        with self._write() as conn:
            cursor = conn.execute(
                "DELETE FROM messages WHERE conversation_id = ? AND position >= ?",
                (conversation_id, position),
            )
        return cursor.rowcount

    # -- app state -------------------------------------------------------------------------

    def get_state(self, key: str, default: Any = None) -> Any:
        """A JSON value the app kept under `key`, or `default`."""
        row = self._conn.execute("SELECT value FROM app_state WHERE key = ?", (key,)).fetchone()
        if row is None:
            return default
        try:
            return json.loads(row[0])
        except json.JSONDecodeError:
            return default

    def set_state(self, key: str, value: Any) -> None:
        """Keep a JSON-serialisable value under `key` (None removes it)."""
        with self._write() as conn:
            if value is None:
                conn.execute("DELETE FROM app_state WHERE key = ?", (key,))
            else:
                conn.execute(
                    "INSERT INTO app_state (key, value) VALUES (?, ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (key, value_text(value)),
                )

    def last_opened(self) -> int | None:
        """The conversation open when the app was last used, if it still exists."""
        conversation_id = self.get_state(LAST_OPENED_KEY)
        if not isinstance(conversation_id, int):
            return None
        found = self.conversation(conversation_id)
        return conversation_id if found is not None and found.deleted is None else None

    def set_last_opened(self, conversation_id: int | None) -> None:
        self.set_state(LAST_OPENED_KEY, conversation_id)


class JsonArray:
    """A JSON array encoded a run of items at a time, as they come: a long reply's token
    confidences are then stored at its end without encoding them all in one go (thousands of
    tokens took tens of milliseconds of the window's GUI thread there)."""

    def __init__(self) -> None:
        self._runs: list[str] = []  # each run's items, encoded, without the brackets

    def extend(self, items: Sequence[Any]) -> None:
        if items:
            self._runs.append(json.dumps(list(items))[1:-1])

    def dumps(self) -> str:
        return "[" + ", ".join(self._runs) + "]"


class ReplySaver:
    """Saves a streaming reply at most once per `interval_s`, by the clock it is given.

    Feed it the stream's text (`append` per token, or `set_text` with the whole text so far);
    it calls `store.update_reply` when the interval has passed since the last save. `flush`
    saves now (e.g. when the app quits mid-reply); `finish` stores the final text and stats.
    """

    def __init__(
        self,
        store: ConversationStore,
        message_id: int,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.message_id = message_id
        self.interval_s = interval_s
        self._clock = clock
        self._text = ""
        self._saved_text = ""
        self._last_save = clock()
        self.finished = False

    @property
    def text(self) -> str:
        return self._text

    def append(self, piece: str) -> bool:
        """Add streamed text; returns True if this call saved."""
        return self.set_text(self._text + piece)

    def set_text(self, text: str) -> bool:
        """Replace the text so far; returns True if this call saved."""
        self._text = text
        if self._clock() - self._last_save < self.interval_s:
            return False
        return self.flush()

    def flush(self) -> bool:
        """Save now if anything changed since the last save; returns True if it saved."""
        if self.finished or self._text == self._saved_text:
            return False
        self.store.update_reply(self.message_id, self._text)
        self._saved_text = self._text
        self._last_save = self._clock()
        return True

    def finish(
        self,
        stats: Mapping[str, Any],
        text: str | None = None,
        confidence: Sequence[Any] | JsonArray = (),
    ) -> None:
        """Store the final text (default: what was streamed), stats and token confidences;
        the reply is complete."""
        if text is not None:
            self._text = text
        self.store.finish_reply(self.message_id, self._text, stats, confidence)
        self._saved_text = self._text
        self.finished = True


def _clean_title(title: str) -> str:
    # One line: titles come from typing and from first messages.
    return " ".join(title.split())
