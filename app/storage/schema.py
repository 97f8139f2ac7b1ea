"""The store's file: its schema, brought up to date when it is opened, and what happens to a
file that cannot serve.

The schema is versioned with `PRAGMA user_version`; `MIGRATIONS[n]` takes a database from
version n to n + 1, so an old file is brought up to date when it is opened. A file that is not
SQLite, is damaged or holds somebody else's tables is `UnusableDatabase`: the store moves it
aside (`set_aside`: `<name>.corrupt-<timestamp>`) and starts a fresh one. A file written by a
newer Glassbox is `NewerDatabase`: nothing is wrong with it, so it is left as it is for the
newer version, and this one keeps its conversations elsewhere (the window: in memory).
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from pathlib import Path

# Each script takes the database from version n to n + 1 (index n). Append, never edit.
MIGRATIONS: tuple[str, ...] = (
    # 1: conversations and their messages.
    """
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        created REAL NOT NULL,
        updated REAL NOT NULL,
        model TEXT,
        system_prompt TEXT NOT NULL DEFAULT '',
        settings TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL,
        text TEXT NOT NULL DEFAULT '',
        created REAL NOT NULL,
        model TEXT,
        settings TEXT NOT NULL DEFAULT '{}',
        complete INTEGER NOT NULL DEFAULT 1,
        stats TEXT NOT NULL DEFAULT '{}',
        UNIQUE (conversation_id, position)
    );
    """,
    # 2: soft delete (so a deletion can be undone) and a key-value table for app state.
    """
    ALTER TABLE conversations ADD COLUMN deleted REAL;
    CREATE INDEX conversations_by_update ON conversations (deleted, updated);
    CREATE TABLE app_state (
        key TEXT PRIMARY KEY,
        value TEXT NOT NULL
    );
    """,
    # 3: completion mode per conversation (text continued as written, no chat template).
    """
    ALTER TABLE conversations ADD COLUMN completion INTEGER NOT NULL DEFAULT 0;
    """,
    # 4: how sure the model was of each token of a reply (ui.confidence), as JSON.
    """
    ALTER TABLE messages ADD COLUMN confidence TEXT NOT NULL DEFAULT '[]';
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
OUR_TABLES = frozenset({"conversations", "messages", "app_state"})
BUSY_TIMEOUT_S = 5.0
# Damage that makes a file unusable; anything else (a lock, a full disk) is raised as is.
_DAMAGE_ERRORS = ("SQLITE_NOTADB", "SQLITE_CORRUPT")
_SIDECARS = ("-wal", "-shm", "-journal")


class UnusableDatabase(Exception):
    """The file cannot serve as our store; the message says why."""


class NewerDatabase(Exception):
    """The file was written by a newer Glassbox: left untouched, for that version to read."""


def open_database(path: Path) -> sqlite3.Connection:
    """A connection to the store's file in WAL mode, checked ours and migrated to
    SCHEMA_VERSION; UnusableDatabase if the file cannot serve."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
    try:
        conn.row_factory = sqlite3.Row
        conn.create_function("casefold", 1, _casefold, deterministic=True)
        _check(conn)
        conn.execute("PRAGMA journal_mode = WAL")
        # FULL: a finished message survives a power cut, not only a crash; writes are rare.
        conn.execute("PRAGMA synchronous = FULL")
        conn.execute("PRAGMA foreign_keys = ON")
        _migrate(conn)
    except sqlite3.DatabaseError as error:
        conn.close()
        if getattr(error, "sqlite_errorname", "").startswith(_DAMAGE_ERRORS):
            raise UnusableDatabase(f"damaged or not a database: {error}") from error
        raise
    except BaseException:
        conn.close()
        raise
    return conn


def _check(conn: sqlite3.Connection) -> None:
    """Read-only checks, before anything is written to a file that may not be ours."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise NewerDatabase(
            f"written by a newer Glassbox (schema {version}; this one knows {SCHEMA_VERSION})"
        )
    tables = {
        row[0]
        for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        )
    }
    if version == 0 and tables:
        raise UnusableDatabase(f"not a Glassbox database (tables: {', '.join(sorted(tables))})")
    if unknown := tables - OUR_TABLES:
        raise UnusableDatabase(f"unknown tables: {', '.join(sorted(unknown))}")
    problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
    if problems != ["ok"]:
        raise UnusableDatabase(f"damaged: {'; '.join(problems[:3])}")


def _migrate(conn: sqlite3.Connection) -> None:
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    for target in range(version + 1, SCHEMA_VERSION + 1):
        # One transaction per step: a crash mid-migration leaves the previous version.
        try:
            conn.executescript(
                f"BEGIN IMMEDIATE;\n{MIGRATIONS[target - 1]}\n"
                f"PRAGMA user_version = {target};\nCOMMIT;"
            )
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise


def _casefold(text: str | None) -> str:
    return text.casefold() if text else ""


def _aside_name(path: Path, moment: float) -> Path:
    stamp = datetime.fromtimestamp(moment).strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.name}.corrupt-{stamp}")
    counter = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.corrupt-{stamp}-{counter}")
        counter += 1
    return candidate


def set_aside(path: Path, moment: float) -> Path:
    """Move a damaged database (and its WAL files) out of the way; return its new path."""
    target = _aside_name(path, moment)
    path.replace(target)
    for suffix in _SIDECARS:
        sidecar = path.with_name(path.name + suffix)
        if sidecar.exists():
            sidecar.replace(target.with_name(target.name + suffix))
    return target
