"""What the store holds, as Python sees it: a conversation and a message, read from their
tables' rows, with settings and stats as JSON text in the table and dicts here."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from engine.settings import GenerationSettings, Message


@dataclass(frozen=True, slots=True)
class StoredConversation:
    """One chat. Times are Unix seconds; `deleted` is set while a deletion can be undone."""

    id: int
    title: str
    created: float
    updated: float
    model: str | None
    system_prompt: str
    settings: dict[str, Any]
    deleted: float | None = None
    completion: bool = False  # completion mode: the text is continued, no chat template


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message. `complete` is False for a reply that was cut off while streaming."""

    id: int
    conversation_id: int
    position: int
    role: str
    text: str
    created: float
    model: str | None
    settings: dict[str, Any]
    complete: bool
    stats: dict[str, Any]
    # each token's [text, probability or null, runners-up] (ui.confidence); [] when not kept
    confidence: list[Any] = dataclasses.field(default_factory=list)

    def as_message(self) -> Message:
        """The message as the chat template takes it."""
        return Message(self.role, self.text)


def settings_to_dict(settings: GenerationSettings | Mapping[str, Any] | None) -> dict[str, Any]:
    if settings is None:
        return {}
    if dataclasses.is_dataclass(settings) and not isinstance(settings, type):
        return dataclasses.asdict(settings)
    return dict(settings)


def generation_settings(data: Mapping[str, Any]) -> GenerationSettings:
    """Stored settings back as GenerationSettings; unknown keys (from other versions) are skipped.

    Raises engine.settings.SettingsError if a stored value is out of range.
    """
    known = {field.name for field in dataclasses.fields(GenerationSettings)}
    values = {key: value for key, value in data.items() if key in known}
    if "stop_strings" in values:
        values["stop_strings"] = tuple(values["stop_strings"])
    return GenerationSettings(**values)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot store {type(value).__name__} as JSON")


def dumps(value: Mapping[str, Any]) -> str:
    return json.dumps(dict(value), default=_json_default, ensure_ascii=False)


def value_text(value: Any) -> str:
    """Any JSON-able value (an app-state entry) as its text in the table."""
    return json.dumps(value, default=_json_default)


def loads(text: str | None) -> dict[str, Any]:
    try:
        value = json.loads(text or "{}")
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def loads_list(text: str | None) -> list[Any]:
    try:
        value = json.loads(text or "[]")
    except json.JSONDecodeError:
        return []
    return value if isinstance(value, list) else []


JSON_COLUMNS = frozenset({"settings", "stats"})  # text in the table, dicts in Python
Stored = TypeVar("Stored", StoredConversation, StoredMessage)


def from_row(kind: type[Stored], row: sqlite3.Row) -> Stored:
    """A stored conversation or message from its table's row: the columns are named as the
    fields; the JSON ones are parsed and SQLite's 0/1 flags become bools."""
    values = {}
    for field in dataclasses.fields(kind):
        value = row[field.name]
        if field.name in JSON_COLUMNS:
            value = loads(value)
        elif field.name == "confidence":
            value = loads_list(value)
        elif field.type == "bool":  # a string: this module's annotations are postponed
            value = bool(value)
        values[field.name] = value
    return kind(**values)


def conversation_from_row(row: sqlite3.Row) -> StoredConversation:
    return from_row(StoredConversation, row)


def message_from_row(row: sqlite3.Row) -> StoredMessage:
    return from_row(StoredMessage, row)
