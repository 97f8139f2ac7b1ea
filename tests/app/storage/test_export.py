"""Exporting a conversation as Markdown and as JSON."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from app.storage.export import (
    export_conversation,
    render,
    suggested_filename,
    to_json,
    to_markdown,
)
from app.storage.store import ConversationStore, ReplySaver
from engine.settings import GenerationSettings
from ui.reply_stats import stats_line

START = 1_700_000_000.0
STATS = {
    "finish_reason": "eos",
    "prompt_tokens": 42,
    "reused_tokens": 30,
    "generated_tokens": 21,
    "ttft_s": 0.123,
    "decode_s": 1.0,
    "decode_tokens_per_s": 20.0,
}


@pytest.fixture
def store(tmp_path):
    ticks = iter(range(1000))
    with ConversationStore(tmp_path / "c.sqlite3", clock=lambda: START + next(ticks)) as opened:
        yield opened


@pytest.fixture
def chat(store):
    cid = store.create_conversation(
        "Trip to Rome",
        model="SmolLM2-135M",
        system_prompt="Be brief.",
        settings=GenerationSettings(seed=3, stop_strings=("User:",)),
    )
    store.add_message(cid, "user", "Plan a day in **Rome**")
    reply = store.begin_reply(cid, "SmolLM2-135M", GenerationSettings(seed=3))
    store.finish_reply(reply, "Start at the Colosseum.\n", STATS)
    store.add_message(cid, "user", "And the evening?")
    cut = store.begin_reply(cid, "SmolLM2-135M")
    saver = ReplySaver(store, cut, interval_s=0)
    saver.append("Trastevere for")
    return cid


def test_markdown_has_title_roles_text_and_stats(store, chat):
    text = to_markdown(store.conversation(chat), store.messages(chat))
    lines = text.splitlines()
    assert lines[0] == "# Trip to Rome"
    assert "- Model: SmolLM2-135M" in lines
    created = datetime.fromtimestamp(START).astimezone().strftime("%Y-%m-%d %H:%M")
    assert any(line.startswith(f"- Created: {created}") for line in lines)
    assert [line for line in lines if line.startswith("## ")] == [
        "## System prompt",
        "## User",
        "## Assistant",
        "## User",
        "## Assistant",
    ]
    assert "Be brief." in lines and "Plan a day in **Rome**" in lines
    assert "Start at the Colosseum." in lines
    assert (
        "*SmolLM2-135M · 42-token prompt (30 reused) · 21 tokens · TTFT 0.12 s · 20.0 tok/s*"
    ) in lines
    assert "Trastevere for" in lines
    assert lines[-1] == "*SmolLM2-135M · incomplete: the reply was interrupted*"
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_stats_line_leaves_out_what_is_missing():
    assert stats_line({}) == ""
    assert stats_line({"prompt_tokens": 5, "reused_tokens": 0}) == "5-token prompt"
    assert stats_line({"generated_tokens": 1, "decode_tokens_per_s": 0.0}) == "1 token"
    assert stats_line({"finish_reason": "length", "ttft_s": 0.5}) == "TTFT 0.50 s · length limit"


def test_json_holds_every_field(store, chat):
    document = json.loads(to_json(store.conversation(chat), store.messages(chat)))
    assert document["format"] == "glassbox.conversation" and document["format_version"] == 1
    conversation = document["conversation"]
    assert conversation["title"] == "Trip to Rome" and conversation["id"] == chat
    assert conversation["model"] == "SmolLM2-135M" and conversation["system_prompt"] == "Be brief."
    assert conversation["settings"]["seed"] == 3
    assert conversation["settings"]["stop_strings"] == ["User:"]
    assert datetime.fromisoformat(conversation["created"]).timestamp() == START
    messages = document["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert [m["position"] for m in messages] == [0, 1, 2, 3]
    assert set(messages[1]) == {
        "id",
        "position",
        "role",
        "text",
        "created",
        "model",
        "settings",
        "complete",
        "stats",
        "confidence",
    }
    assert messages[1]["text"] == "Start at the Colosseum.\n"
    assert messages[1]["stats"] == STATS and messages[1]["complete"] is True
    assert messages[1]["settings"]["seed"] == 3
    assert messages[3]["text"] == "Trastevere for" and messages[3]["complete"] is False


def test_export_writes_the_file(store, chat, tmp_path):
    for fmt in ("md", "json"):
        target = tmp_path / suggested_filename(store.conversation(chat), fmt)
        assert export_conversation(store, chat, fmt, target) == target
        assert target.read_text(encoding="utf-8") == render(
            store.conversation(chat), store.messages(chat), fmt
        )
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".md", ".json")) == [
        "trip-to-rome.json",
        "trip-to-rome.md",
    ]
    with pytest.raises(ValueError, match="format"):
        export_conversation(store, chat, "pdf", tmp_path / "x.pdf")
    with pytest.raises(KeyError):
        export_conversation(store, chat + 99, "md", tmp_path / "x.md")
    assert not (tmp_path / "x.pdf").exists() and not (tmp_path / "x.md").exists()


def test_suggested_filename_is_safe(store):
    odd = store.conversation(store.create_conversation('What is 2/3 of "π"? <ok>'))
    assert suggested_filename(odd, "md") == "what-is-2-3-of-π-ok.md"
    symbols = store.conversation(store.create_conversation("???"))
    assert suggested_filename(symbols, "json") == f"conversation-{symbols.id}.json"
