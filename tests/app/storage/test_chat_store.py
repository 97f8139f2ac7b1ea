"""`glassbox chat` keeps its conversations in the window's store, and a kill loses no finished
message: the real program in a separate process, then the SQLite file it left behind."""

from __future__ import annotations

import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from app.paths import DATABASE_NAME
from app.storage.chat_log import ChatLog, open_store
from app.storage.store import SCHEMA_VERSION, ConversationStore
from engine.events import Failed, Finished, PrefillDone, Token
from engine.settings import GenerationSettings
from tests.models import make_tiny
from ui.reply_stats import finished_stats

ROOT = Path(__file__).resolve().parents[3]
WAIT_S = 120  # the most any one step below may take on a busy machine
STATS_KEYS = set(finished_stats(Finished("eos", "", 0, 0, 0, 0, 0, 0, 0, 0)))


@pytest.fixture(scope="module")
def tiny_folder(tokenizer, tmp_path_factory) -> Path:
    """A tiny Llama on disk; its long context lets a sampled reply stream until it is stopped."""
    folder = tmp_path_factory.mktemp("chat-store-llama")
    make_tiny(tokenizer, "llama", max_position_embeddings=8192).model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def environment(data_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "GLASSBOX_DATA_DIR": str(data_dir),
        "PYTHONIOENCODING": "utf-8",
    }


def chat(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "app", "chat", *args],
        cwd=ROOT,
        env=environment(data_dir),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=WAIT_S,
    )


def one_shot(data_dir: Path, folder: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list]:
    result = chat(
        data_dir, "--model", str(folder), "--prompt", "Where do  rivers\nbegin?", "--greedy",
        "--max-new-tokens", "6", "--system", "Answer briefly.", "--json", *extra,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result, [json.loads(line) for line in result.stdout.splitlines()]


def stored(data_dir: Path) -> tuple[ConversationStore, list]:
    store = ConversationStore(data_dir / DATABASE_NAME)
    return store, store.list_conversations()


@pytest.fixture(scope="module")
def stored_run(tiny_folder, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("data")
    return data_dir, *one_shot(data_dir, tiny_folder)


def test_a_one_shot_chat_is_stored_with_the_stats_it_printed(stored_run, tiny_folder):
    data_dir, _result, events = stored_run
    finished = events[-1]
    store, (conversation,) = stored(data_dir)
    assert conversation.title == "Where do rivers begin?"
    assert conversation.model == str(tiny_folder)
    assert conversation.system_prompt == "Answer briefly."
    assert conversation.settings["greedy"] is True
    assert conversation.settings["max_new_tokens"] == 6
    user, reply = store.messages(conversation.id)
    assert (user.role, user.text, user.complete) == ("user", "Where do  rivers\nbegin?", True)
    assert (reply.role, reply.text, reply.complete) == ("assistant", finished["text"], True)
    assert set(reply.stats) == STATS_KEYS
    assert reply.stats == {key: finished[key] for key in STATS_KEYS}
    assert reply.stats["generated_tokens"] == 6 and reply.stats["finish_reason"] == "length"
    store.close()


def test_no_store_keeps_nothing_and_prints_the_same_events(stored_run, tiny_folder, tmp_path):
    _data_dir, _result, kept_events = stored_run
    result, events = one_shot(tmp_path, tiny_folder, "--no-store")
    assert not (tmp_path / DATABASE_NAME).exists()
    assert "glassbox chat:" not in result.stderr

    def shape(lines: list) -> list:  # everything but the timings
        return [(e["event"], e.get("token_id"), e.get("text"), e.get("index")) for e in lines]

    assert shape(events) == shape(kept_events)
    assert set(events[-1]) == set(kept_events[-1])


def test_a_damaged_store_is_set_aside_with_one_line(tiny_folder, tmp_path):
    (tmp_path / DATABASE_NAME).write_bytes(b"not a database at all " * 200)
    result, events = one_shot(tmp_path, tiny_folder)
    notes = [line for line in result.stderr.splitlines() if line.startswith("glassbox chat:")]
    assert len(notes) == 1 and "damaged" in notes[0] and "kept aside" in notes[0], result.stderr
    assert [e["event"] for e in events][-1] == "finished"  # stdout is JSON lines as ever
    (aside,) = tmp_path.glob(f"{DATABASE_NAME}.corrupt-*")
    assert str(aside) in notes[0]
    store, (conversation,) = stored(tmp_path)
    assert [m.role for m in store.messages(conversation.id)] == ["user", "assistant"]
    store.close()


class ChatProcess:
    """An interactive `glassbox chat --json` whose stdout lines are read as they come."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.stderr = (data_dir / "stderr.txt").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "app", "chat", "--json", *args],
            cwd=ROOT,
            env=environment(data_dir),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
            encoding="utf-8",
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def say(self, text: str) -> None:
        self.process.stdin.write(text + "\n")
        self.process.stdin.flush()

    def event(self) -> dict:
        line = self.lines.get(timeout=WAIT_S)
        assert line is not None, f"chat ended early: {self.process.wait(WAIT_S)}"
        return json.loads(line)

    def rest(self) -> list[dict]:
        """The events printed before the process ended."""
        self.reader.join(WAIT_S)
        lines = []
        while (line := self.lines.get_nowait()) is not None:
            lines.append(json.loads(line))
        return lines

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(WAIT_S)
        self.stderr.close()


def last_reply(database: Path) -> tuple[str, int] | None:
    """The newest assistant message's text and complete flag, read as another process would."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True) as conn:
        return conn.execute(
            "SELECT text, complete FROM messages WHERE role = 'assistant' ORDER BY id DESC LIMIT 1"
        ).fetchone()


def test_a_chat_killed_mid_reply_loses_no_finished_message(tiny_folder, tmp_path):
    database = tmp_path / DATABASE_NAME
    chat_process = ChatProcess(
        tmp_path, "--model", str(tiny_folder),
        "--temperature", "1.0", "--seed", "5", "--max-new-tokens", "6000",
    )  # fmt: skip
    try:
        # First turn: Ctrl+C after a few tokens ends the reply as the window's Stop does.
        chat_process.say("First question")
        tokens = 0
        while tokens < 3:
            tokens += chat_process.event()["event"] == "token"
        chat_process.process.send_signal(signal.SIGINT)
        while (first := chat_process.event())["event"] != "finished":
            pass
        assert first["finish_reason"] == "cancelled" and first["generated_tokens"] >= 3

        # Second turn: killed once the saver has stored part of the reply (about 1 s in).
        chat_process.say("Second question")
        streamed, deadline = [], time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            event = chat_process.event()
            assert event["event"] != "finished", "the reply ended before it could be killed"
            if event["event"] == "token":
                streamed.append(event["text"])
                saved = last_reply(database)
                if saved is not None and saved[0] and not saved[1]:
                    break
        else:
            pytest.fail("the streaming reply was never saved")
        chat_process.process.send_signal(signal.SIGKILL)
        assert chat_process.process.wait(WAIT_S) == -signal.SIGKILL
        streamed += [e["text"] for e in chat_process.rest() if e["event"] == "token"]
    finally:
        chat_process.close()

    store, (conversation,) = stored(tmp_path)
    assert store.recovered_from is None  # the file is whole
    user, reply, second_user, partial = store.messages(conversation.id)
    assert (user.text, user.complete) == ("First question", True)
    assert (reply.text, reply.complete) == (first["text"], True)
    assert reply.stats == {key: first[key] for key in STATS_KEYS}
    assert (second_user.text, second_user.complete) == ("Second question", True)
    assert partial.role == "assistant" and not partial.complete and partial.stats == {}
    assert partial.text and "".join(streamed).startswith(partial.text)
    store.close()


# -- ChatLog in-process: the parts a run of the program cannot reach -----------------------------


def prefill() -> PrefillDone:
    return PrefillDone(3, 0, 3, 0.0, 0.01, 0, (), (1, 2, 3), ("a", "b", "c"))


def token(index: int, text: str) -> Token:
    return Token(index, 100 + index, text, text, 0.01, 0, ())


def test_the_terminal_leaves_a_deletion_the_window_can_still_undo(tmp_path):
    window_store = ConversationStore(tmp_path / DATABASE_NAME)
    deleted = window_store.create_conversation("Deleted a moment ago")
    window_store.delete(deleted)
    terminal_store = open_store(tmp_path / DATABASE_NAME, report=pytest.fail)
    terminal_store.close()
    window_store.restore(deleted)  # raises KeyError if the terminal had purged it
    assert window_store.conversation(deleted).deleted is None
    window_store.close()


def test_new_starts_another_conversation_and_a_refused_turn_stores_no_reply(tmp_path):
    store = ConversationStore(tmp_path / DATABASE_NAME)
    log = ChatLog(store, "tiny", "", GenerationSettings())
    log.user("A message far too long")  # context full: no prefill, so no reply row
    for event in (Failed("too long", "ContextFull"), Finished("context_full", "", *[0] * 8)):
        log.record(event)
    first = log.conversation_id
    log.new_conversation()
    log.user("Short")
    log.record(prefill())
    log.record(token(0, "Hi"))
    log.interrupted()  # the second Ctrl+C: what streamed is saved, incomplete
    assert [(m.role, m.text) for m in store.messages(first)] == [("user", "A message far too long")]
    user, cut = store.messages(log.conversation_id)
    assert user.text == "Short" and (cut.text, cut.complete) == ("Hi", False)
    log.close()


def test_a_store_that_fails_mid_chat_is_reported_once_and_the_chat_goes_on(tmp_path):
    store = ConversationStore(tmp_path / DATABASE_NAME)
    reports: list[str] = []
    log = ChatLog(store, "tiny", "", GenerationSettings(), report=reports.append)
    log.user("Saved")
    store._conn.close()  # as if the file went away under the running chat
    log.record(prefill())
    log.record(token(0, "lost"))
    log.user("Not saved")
    log.close()
    assert len(reports) == 1 and "unsaved" in reports[0]
    assert log.store is None
    reopened = ConversationStore(tmp_path / DATABASE_NAME)
    (conversation,) = reopened.list_conversations()
    assert [m.text for m in reopened.messages(conversation.id)] == ["Saved"]
    reopened.close()


def test_a_newer_glassboxs_store_is_left_alone_and_the_chat_is_not_saved(tmp_path):
    path = tmp_path / DATABASE_NAME
    ConversationStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    said: list[str] = []
    assert open_store(path, report=said.append) is None
    (line,) = said
    assert "newer Glassbox" in line and "not saved" in line
    assert not list(tmp_path.glob("*.corrupt-*"))
