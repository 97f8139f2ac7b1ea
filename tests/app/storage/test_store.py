"""The conversation store: round trips, durability, migrations and recovery from bad files."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from app import paths
from app.storage import schema
from app.storage.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ConversationStore,
    NewerDatabase,
    ReplySaver,
    generation_settings,
    set_aside,
)
from engine.events import Finished
from engine.settings import GenerationSettings, Message
from ui.reply_stats import finished_stats

REPO_ROOT = Path(__file__).resolve().parents[3]


class Clock:
    """A clock that moves one second per reading, so every write has its own time."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "conversations.sqlite3"


@pytest.fixture
def store(db_path: Path):
    with ConversationStore(db_path, clock=Clock()) as opened:
        yield opened


def finished(text: str = "Hi there.", reason: str = "eos") -> Finished:
    return Finished(
        reason=reason,
        text=text,
        prompt_tokens=40,
        reused_tokens=30,
        generated_tokens=11,
        tokenize_s=0.001,
        prefill_s=0.05,
        ttft_s=0.06,
        decode_s=0.5,
        total_s=0.56,
    )


def aside_files(db_path: Path) -> list[Path]:
    return sorted(p for p in db_path.parent.iterdir() if ".corrupt-" in p.name)


# -- paths ---------------------------------------------------------------------------------


def test_data_dir_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.DATA_DIR_ENV, str(tmp_path / "data"))
    assert paths.data_dir() == tmp_path / "data" and (tmp_path / "data").is_dir()
    assert paths.database_path() == tmp_path / "data" / paths.DATABASE_NAME


def test_data_dir_defaults_to_the_platform_folder(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.DATA_DIR_ENV, raising=False)
    seen: list[str] = []

    def user_data_dir(appname: str, appauthor: object) -> str:
        seen.append(appname)
        return str(tmp_path / "platform")

    monkeypatch.setattr(paths.platformdirs, "user_data_dir", user_data_dir)
    assert paths.data_dir() == tmp_path / "platform"
    assert seen == ["glassbox"] and (tmp_path / "platform").is_dir()


# -- basics --------------------------------------------------------------------------------


def test_a_new_store_is_in_wal_mode_at_the_current_schema(store, db_path):
    assert store.recovered_from is None and store.recovery_reason is None
    assert store.schema_version == SCHEMA_VERSION == len(MIGRATIONS)
    with sqlite3.connect(db_path) as other:
        assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert other.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_conversation_and_messages_round_trip(db_path):
    settings = GenerationSettings(temperature=0.5, seed=7, stop_strings=("User:",))
    with ConversationStore(db_path, clock=Clock()) as store:
        cid = store.create_conversation(
            "  Trip\nto Rome ", model="SmolLM2", system_prompt="Be brief.", settings=settings
        )
        store.add_message(cid, "user", "Plan a day in Rome")
        reply = store.begin_reply(cid, "SmolLM2", settings)
        store.finish_reply(reply, "Start at the Colosseum.", finished_stats(finished()))

    with ConversationStore(db_path) as store:
        conversation = store.conversation(cid)
        assert conversation.title == "Trip to Rome"
        assert conversation.model == "SmolLM2" and conversation.system_prompt == "Be brief."
        assert generation_settings(conversation.settings) == settings
        user, assistant = store.messages(cid)
    assert (user.position, user.role, user.text, user.complete) == (
        0,
        "user",
        "Plan a day in Rome",
        True,
    )
    assert user.as_message() == Message("user", "Plan a day in Rome")
    assert (assistant.position, assistant.role, assistant.complete) == (1, "assistant", True)
    assert assistant.text == "Start at the Colosseum." and assistant.model == "SmolLM2"
    assert generation_settings(assistant.settings) == settings
    assert assistant.stats["finish_reason"] == "eos"
    assert assistant.stats["prompt_tokens"] == 40 and assistant.stats["reused_tokens"] == 30
    assert assistant.stats["generated_tokens"] == 11 and assistant.stats["ttft_s"] == 0.06
    assert assistant.stats["decode_tokens_per_s"] == pytest.approx(10 / 0.5)


def test_list_is_newest_first_and_a_new_message_moves_a_chat_up(store):
    first = store.create_conversation("first")
    second = store.create_conversation("second")
    third = store.create_conversation("third")
    assert [c.id for c in store.list_conversations()] == [third, second, first]
    store.add_message(first, "user", "hello again")
    listed = store.list_conversations()
    assert [c.id for c in listed] == [first, third, second]
    assert listed[0].updated > listed[1].updated
    assert [c.id for c in store.list_conversations(limit=2)] == [first, third]


def test_messages_are_checked(store):
    cid = store.create_conversation()
    with pytest.raises(ValueError, match="role"):
        store.add_message(cid, "narrator", "Once")
    with pytest.raises(KeyError):
        store.add_message(cid + 100, "user", "hello")
    reply = store.begin_reply(cid, "m")
    store.finish_reply(reply, "done", {})
    with pytest.raises(ValueError, match="already finished"):
        store.update_reply(reply, "late partial save")
    with pytest.raises(KeyError):
        store.finish_reply(reply + 100, "x", {})
    assert store.message(reply).text == "done"


def test_the_store_refuses_other_threads(store):
    errors: list[BaseException] = []

    def use() -> None:
        try:
            store.list_conversations()
        except BaseException as error:
            errors.append(error)

    worker = threading.Thread(target=use)
    worker.start()
    worker.join()
    assert len(errors) == 1 and isinstance(errors[0], sqlite3.ProgrammingError)


# -- durability ----------------------------------------------------------------------------


def test_each_write_is_committed_at_once(store, db_path):
    cid = store.create_conversation("durable")
    store.add_message(cid, "user", "question")
    reply = store.begin_reply(cid, "m")
    store.update_reply(reply, "partial ans")
    # A second connection (another process would see the same) reads while the store is open.
    other = sqlite3.connect(db_path)
    try:
        rows = other.execute(
            "SELECT role, text, complete FROM messages WHERE conversation_id = ? ORDER BY position",
            (cid,),
        ).fetchall()
        assert rows == [("user", "question", 1), ("assistant", "partial ans", 0)]
        store.finish_reply(reply, "partial answer, finished", {"finish_reason": "eos"})
        assert other.execute(
            "SELECT text, complete FROM messages WHERE id = ?", (reply,)
        ).fetchone() == (
            "partial answer, finished",
            1,
        )
    finally:
        other.close()


def test_an_unfinished_reply_stays_incomplete_after_reopening(db_path):
    with ConversationStore(db_path) as store:
        cid = store.create_conversation()
        reply = store.begin_reply(cid, "m")
        store.update_reply(reply, "half a thou")
    with ConversationStore(db_path) as store:
        (message,) = store.messages(cid)
    assert (message.text, message.complete, message.stats) == ("half a thou", False, {})


def test_a_killed_process_leaves_finished_messages_and_a_partial_reply(db_path):
    script = """
import sys
from app.storage.store import ConversationStore

store = ConversationStore(sys.argv[1])
cid = store.create_conversation("Killed mid-reply")
store.add_message(cid, "user", "Tell me a story")
first = store.begin_reply(cid, "tiny")
store.finish_reply(first, "Once upon a time.", {"finish_reason": "eos", "generated_tokens": 5})
store.add_message(cid, "user", "Go on")
reply = store.begin_reply(cid, "tiny")
store.update_reply(reply, "And then")
print(cid, flush=True)
step = 0
while True:  # keep writing, so the kill lands in the middle of the stream
    step += 1
    store.update_reply(reply, f"And then {step}")
"""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(db_path)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        cid = int(child.stdout.readline())
    finally:
        child.kill()  # SIGKILL: no cleanup, no checkpoint
        child.wait(timeout=30)
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL

    with ConversationStore(db_path) as store:
        assert store.recovered_from is None
        messages = store.messages(cid)
        assert [(m.role, m.complete) for m in messages] == [
            ("user", True),
            ("assistant", True),
            ("user", True),
            ("assistant", False),
        ]
        assert messages[1].text == "Once upon a time."
        assert messages[1].stats == {"finish_reason": "eos", "generated_tokens": 5}
        assert messages[2].text == "Go on"
        assert messages[3].text.startswith("And then")
    with sqlite3.connect(db_path) as check:
        assert check.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


# -- ReplySaver ----------------------------------------------------------------------------


class ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_reply_saver_saves_at_most_once_per_interval(store):
    cid = store.create_conversation()
    reply = store.begin_reply(cid, "m")
    clock = ManualClock()
    saver = ReplySaver(store, reply, interval_s=1.0, clock=clock)

    assert saver.append("Hel") is False  # less than a second since the reply began
    clock.now += 0.5
    assert saver.append("lo") is False
    assert store.message(reply).text == ""
    clock.now += 0.5
    assert saver.append(",") is True
    assert store.message(reply).text == "Hello,"
    clock.now += 0.9
    assert saver.append(" wor") is False
    assert store.message(reply).text == "Hello,"
    clock.now += 0.1
    assert saver.set_text("Hello, world") is True
    assert store.message(reply).text == "Hello, world"
    clock.now += 5
    assert saver.flush() is False  # nothing new since the last save
    saver.append("!")
    assert store.message(reply).complete is False

    saver.finish({"finish_reason": "eos"})
    message = store.message(reply)
    assert (message.text, message.complete, message.stats) == (
        "Hello, world!",
        True,
        {"finish_reason": "eos"},
    )
    assert saver.finished and saver.flush() is False


def test_reply_saver_flush_and_final_text(store):
    cid = store.create_conversation()
    reply = store.begin_reply(cid, "m")
    saver = ReplySaver(store, reply, clock=ManualClock())
    saver.append("partial")
    assert saver.flush() is True and store.message(reply).text == "partial"
    saver.finish({"finish_reason": "stop_string"}, text="partial, trimmed")
    assert store.message(reply).text == "partial, trimmed"


# -- migrations ----------------------------------------------------------------------------


def make_v1_database(path: Path) -> None:
    """A database exactly as the first schema version wrote it."""
    conn = sqlite3.connect(path)
    conn.executescript(MIGRATIONS[0])
    conn.execute(
        "INSERT INTO conversations (id, title, created, updated, model, system_prompt, settings)"
        " VALUES (1, 'Old chat', 10.0, 20.0, 'old-model', 'Be kind.', '{\"temperature\": 0.3}')"
    )
    conn.execute(
        "INSERT INTO messages (conversation_id, position, role, text, created, stats)"
        " VALUES (1, 0, 'user', 'Hello from v1', 11.0, '{}')"
    )
    conn.execute("PRAGMA user_version = 1")
    conn.commit()
    conn.close()


def test_a_version_1_database_is_migrated_and_keeps_its_data(db_path):
    make_v1_database(db_path)
    with ConversationStore(db_path) as store:
        assert store.recovered_from is None
        assert store.schema_version == SCHEMA_VERSION
        (old,) = store.list_conversations()
        assert (old.title, old.model, old.system_prompt) == ("Old chat", "old-model", "Be kind.")
        assert old.settings == {"temperature": 0.3} and old.deleted is None
        assert [m.text for m in store.messages(1)] == ["Hello from v1"]
        # What version 2 added works on the migrated file.
        store.set_last_opened(1)
        assert store.last_opened() == 1
        store.delete(1)
        assert store.list_conversations() == []
    with sqlite3.connect(db_path) as check:
        columns = {row[1] for row in check.execute("PRAGMA table_info(conversations)")}
        assert "deleted" in columns


def test_completion_mode_is_kept_per_conversation_and_old_files_default_to_chat(db_path):
    make_v1_database(db_path)  # written before completion mode existed
    with ConversationStore(db_path) as store:
        assert store.conversation(1).completion is False
        store.update_conversation(1, completion=True)
        written = store.create_conversation("Once upon a time", completion=True)
        from_settings = store.create_conversation("s", settings=GenerationSettings(completion=True))
        chat = store.create_conversation("chat", settings=GenerationSettings())
    with ConversationStore(db_path) as store:
        assert store.conversation(1).completion is True
        assert store.conversation(written).completion is True
        assert store.conversation(from_settings).completion is True
        assert store.conversation(chat).completion is False
        store.update_conversation(1, completion=False)
        assert store.conversation(1).completion is False


def test_a_failing_migration_leaves_the_previous_version(db_path, monkeypatch):
    make_v1_database(db_path)
    broken = (*MIGRATIONS, "CREATE TABLE extra (x INTEGER); SELECT no_such_function();")
    monkeypatch.setattr(schema, "MIGRATIONS", broken)
    monkeypatch.setattr(schema, "SCHEMA_VERSION", len(broken))
    with pytest.raises(sqlite3.OperationalError, match="no_such_function"):
        ConversationStore(db_path)
    # Every real step was applied and committed; the failed one left nothing; the file stayed.
    assert aside_files(db_path) == []
    with sqlite3.connect(db_path) as check:
        assert check.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
        tables = {row[0] for row in check.execute("SELECT name FROM sqlite_master")}
        assert "extra" not in tables and "app_state" in tables


# -- damaged and foreign files -------------------------------------------------------------


def test_random_bytes_are_set_aside_and_a_fresh_store_started(db_path):
    garbage = os.urandom(8192)
    db_path.write_bytes(garbage)
    with ConversationStore(db_path, clock=Clock()) as store:
        assert store.recovered_from is not None
        assert store.recovered_from.name.startswith(db_path.name + ".corrupt-")
        assert store.recovered_from.read_bytes() == garbage
        assert "not a database" in store.recovery_reason
        assert store.list_conversations() == []
        cid = store.create_conversation("fresh")
        assert store.conversation(cid).title == "fresh"
    with ConversationStore(db_path) as store:
        assert store.recovered_from is None
        assert [c.title for c in store.list_conversations()] == ["fresh"]


def test_a_damaged_page_is_found_and_set_aside(db_path):
    with ConversationStore(db_path) as store:
        for number in range(60):
            store.add_message(store.create_conversation(f"chat {number}"), "user", "x" * 400)
    data = bytearray(db_path.read_bytes())
    page = 4096
    middle = len(data) // page // 2 * page
    data[middle : middle + page] = b"\xff" * page
    db_path.write_bytes(bytes(data))
    with ConversationStore(db_path) as store:
        assert store.recovered_from is not None and "damaged" in store.recovery_reason
        assert store.list_conversations() == []


def test_a_foreign_sqlite_file_is_set_aside_untouched(db_path):
    with sqlite3.connect(db_path) as foreign:
        foreign.execute("CREATE TABLE photos (id INTEGER PRIMARY KEY, path TEXT)")
        foreign.execute("INSERT INTO photos (path) VALUES ('cat.jpg')")
    with ConversationStore(db_path) as store:
        assert store.recovered_from is not None
        assert "photos" in store.recovery_reason
        assert store.schema_version == SCHEMA_VERSION
    with sqlite3.connect(store.recovered_from) as kept:
        assert kept.execute("SELECT path FROM photos").fetchall() == [("cat.jpg",)]
        assert kept.execute("PRAGMA journal_mode").fetchone()[0] == "delete"  # not converted


def test_unknown_tables_in_our_database_are_set_aside(db_path):
    ConversationStore(db_path).close()
    with sqlite3.connect(db_path) as conn:
        conn.execute("CREATE TABLE somebody_elses (x)")
    with ConversationStore(db_path) as store:
        assert store.recovered_from is not None and "somebody_elses" in store.recovery_reason


def test_a_newer_schema_is_left_as_it_is(db_path):
    """Not damaged: the newer Glassbox that wrote it still reads it, so it is not moved."""
    with ConversationStore(db_path) as store:
        store.create_conversation("from the future")
    with sqlite3.connect(db_path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 5}")
    before = db_path.read_bytes()
    with pytest.raises(NewerDatabase, match="newer Glassbox"):
        ConversationStore(db_path)
    assert db_path.read_bytes() == before and not list(db_path.parent.glob("*.corrupt-*"))
    with sqlite3.connect(db_path) as kept:
        assert kept.execute("SELECT title FROM conversations").fetchall() == [("from the future",)]


def test_set_aside_takes_the_wal_files_along(db_path):
    db_path.write_bytes(b"damaged")
    for suffix in ("-wal", "-shm"):
        db_path.with_name(db_path.name + suffix).write_bytes(suffix.encode())
    moved = set_aside(db_path, 1_700_000_000.0)
    assert not db_path.exists() and moved.read_bytes() == b"damaged"
    # A stale WAL left beside a fresh file would be replayed into it.
    for suffix in ("-wal", "-shm"):
        assert not db_path.with_name(db_path.name + suffix).exists()
        assert moved.with_name(moved.name + suffix).read_bytes() == suffix.encode()


def test_set_aside_names_do_not_collide(db_path):
    moments = []
    for _ in range(2):
        db_path.write_bytes(b"not sqlite at all, just text " * 10)
        with ConversationStore(db_path, clock=lambda: 1_700_000_000.0) as store:
            moments.append(store.recovered_from)
    assert moments[0] != moments[1]
    assert aside_files(db_path) == sorted(moments)


# -- search, rename, delete, state ---------------------------------------------------------


def test_search_matches_titles_and_message_text(store):
    rome = store.create_conversation("Trip to Rome")
    cake = store.create_conversation("Baking")
    store.add_message(cake, "user", "A cake for 100% of the Straße")
    store.add_message(cake, "assistant", "Use ROME apples")
    other = store.create_conversation("Other")
    store.add_message(other, "user", "nothing here")

    assert [c.id for c in store.search("rome")] == [cake, rome]  # newest first
    assert [c.id for c in store.search("STRASSE")] == [cake]  # full Unicode case folding
    assert [c.id for c in store.search("100%")] == [cake]  # no wildcards
    assert [c.id for c in store.search("%")] == [cake]
    assert store.search("_") == []
    assert store.search("zebra") == []
    assert [c.id for c in store.search("  ")] == [c.id for c in store.list_conversations()]
    store.delete(cake)
    assert [c.id for c in store.search("rome")] == [rome]


def test_rename(store):
    cid = store.create_conversation()
    assert store.conversation(cid).title == "New chat"
    store.rename(cid, "  Better\ttitle \n")
    assert store.conversation(cid).title == "Better title"
    with pytest.raises(ValueError):
        store.rename(cid, "   ")
    with pytest.raises(KeyError):
        store.rename(cid + 1, "nobody")


def test_update_conversation_changes_only_what_is_given(store):
    cid = store.create_conversation("t", model="a", system_prompt="old")
    store.update_conversation(cid, settings=GenerationSettings(greedy=True))
    store.update_conversation(cid, system_prompt="")
    conversation = store.conversation(cid)
    assert (conversation.model, conversation.system_prompt) == ("a", "")
    assert generation_settings(conversation.settings) == GenerationSettings(greedy=True)


def test_delete_can_be_undone_until_the_store_is_reopened(db_path):
    with ConversationStore(db_path, clock=Clock()) as store:
        keep = store.create_conversation("keep")
        gone = store.create_conversation("gone")
        store.add_message(gone, "user", "bye")
        store.set_last_opened(gone)

        store.delete(gone)
        assert [c.id for c in store.list_conversations()] == [keep]
        assert store.conversation(gone).deleted is not None
        assert store.last_opened() is None
        store.restore(gone)
        assert [c.id for c in store.list_conversations()] == [gone, keep]
        assert [m.text for m in store.messages(gone)] == ["bye"]
        assert store.last_opened() == gone

        store.delete(gone)
    with ConversationStore(db_path) as store:
        assert store.conversation(gone) is None and store.messages(gone) == []
        with pytest.raises(KeyError):
            store.restore(gone)
        assert [c.id for c in store.list_conversations()] == [keep]


def test_truncate_removes_the_tail(store):
    cid = store.create_conversation()
    for text in ("q1", "a1", "q2", "a2"):
        store.add_message(cid, "user" if text.startswith("q") else "assistant", text)
    assert store.truncate(cid, 3) == 1
    assert [m.text for m in store.messages(cid)] == ["q1", "a1", "q2"]
    store.add_message(cid, "assistant", "a2 again")
    assert [m.position for m in store.messages(cid)] == [0, 1, 2, 3]


def test_app_state_values(store):
    assert store.get_state("window", {"w": 1}) == {"w": 1}
    store.set_state("window", {"width": 1200, "panels": ["kv", "attention"]})
    assert store.get_state("window") == {"width": 1200, "panels": ["kv", "attention"]}
    store.set_state("window", None)
    assert store.get_state("window") is None
    assert store.last_opened() is None
    store.set_last_opened(12345)  # no such conversation
    assert store.last_opened() is None
