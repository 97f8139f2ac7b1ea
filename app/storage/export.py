"""Export a conversation as Markdown (to read) or JSON (every stored field, to process)."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from app.storage.store import ConversationStore, StoredConversation, StoredMessage
from ui.confidence import confidences, markdown_table
from ui.reply_stats import stats_line

ExportFormat = Literal["md", "json"]
FORMATS: tuple[ExportFormat, ...] = ("md", "json")
JSON_FORMAT_NAME = "glassbox.conversation"
JSON_FORMAT_VERSION = 1
ROLE_HEADINGS = {"system": "System", "user": "User", "assistant": "Assistant"}


def _iso(moment: float | None) -> str | None:
    return None if moment is None else datetime.fromtimestamp(moment, UTC).isoformat()


def _local(moment: float) -> str:
    return datetime.fromtimestamp(moment).astimezone().strftime("%Y-%m-%d %H:%M %Z").strip()


def _message_markdown(message: StoredMessage) -> str:
    heading = ROLE_HEADINGS.get(message.role, message.role.title())
    lines = [f"## {heading}", "", message.text.rstrip() or "*(empty)*", ""]
    notes: list[str] = []
    if message.role == "assistant" and message.model:
        notes.append(message.model)
    if message.stats:
        notes.append(stats_line(message.stats))
    if not message.complete:
        notes.append("incomplete: the reply was interrupted")
    if notes := [note for note in notes if note]:
        lines += [f"*{' · '.join(notes)}*", ""]
    if kept := confidences(message.confidence):
        lines += [markdown_table(kept), ""]
    return "\n".join(lines)


def to_markdown(conversation: StoredConversation, messages: Sequence[StoredMessage]) -> str:
    """Title, details, the system prompt, then each message under a role heading with its stats."""
    lines = [f"# {conversation.title}", ""]
    if conversation.model:
        lines.append(f"- Model: {conversation.model}")
    lines += [
        f"- Created: {_local(conversation.created)}",
        f"- Updated: {_local(conversation.updated)}",
        "",
    ]
    parts = ["\n".join(lines)]
    if conversation.system_prompt:
        parts.append(f"## System prompt\n\n{conversation.system_prompt.rstrip()}\n")
    parts += [_message_markdown(message) for message in messages]
    return "\n".join(parts).rstrip() + "\n"


def to_json(conversation: StoredConversation, messages: Sequence[StoredMessage]) -> str:
    """Every stored field; times as ISO 8601 in UTC."""
    document = {
        "format": JSON_FORMAT_NAME,
        "format_version": JSON_FORMAT_VERSION,
        "conversation": {
            "id": conversation.id,
            "title": conversation.title,
            "created": _iso(conversation.created),
            "updated": _iso(conversation.updated),
            "model": conversation.model,
            "system_prompt": conversation.system_prompt,
            "settings": conversation.settings,
        },
        "messages": [
            {
                "id": message.id,
                "position": message.position,
                "role": message.role,
                "text": message.text,
                "created": _iso(message.created),
                "model": message.model,
                "settings": message.settings,
                "complete": message.complete,
                "stats": message.stats,
                "confidence": message.confidence,
            }
            for message in messages
        ],
    }
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def render(conversation: StoredConversation, messages: Sequence[StoredMessage], fmt: str) -> str:
    if fmt == "md":
        return to_markdown(conversation, messages)
    if fmt == "json":
        return to_json(conversation, messages)
    raise ValueError(f"unknown export format {fmt!r}; use one of {', '.join(FORMATS)}")


def suggested_filename(conversation: StoredConversation, fmt: str) -> str:
    """A file name from the title, safe on every platform, e.g. "trip-to-rome.md"."""
    slug = re.sub(r"[^\w]+", "-", conversation.title.casefold()).strip("-_")[:60]
    return f"{slug or f'conversation-{conversation.id}'}.{fmt}"


def export_conversation(
    store: ConversationStore, conversation_id: int, fmt: str, path: Path | str
) -> Path:
    """Write one conversation to `path` in `fmt` ("md" or "json"); raises KeyError if unknown.

    Written to a temporary file first, so a failed export never leaves half a file behind.
    """
    conversation = store.conversation(conversation_id)
    if conversation is None:
        raise KeyError(f"no conversation {conversation_id}")
    text = render(conversation, store.messages(conversation_id), fmt)
    target = Path(path)
    partial = target.with_name(target.name + ".part")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, target)
    return target
