"""The whole window as `glassbox` builds it: a real engine feeding the panels, and the store.

A tiny random Llama runs in the real worker thread; the panels are checked against the events
that reached them, and every message against what SQLite holds afterwards.
"""

from __future__ import annotations

import sqlite3
from functools import partial

import numpy as np

from app.bench.synthetic import SyntheticSession
from app.client.delivery import SLOWEST_DRAIN_MS
from app.storage import recorder
from app.storage.store import SCHEMA_VERSION, ConversationStore, ReplySaver
from engine.events import Finished, PrefillDone, PromptCells, StepRows, Token
from engine.settings import GenerationSettings, Message
from tests.ui.fakes import REPLY, FakeBackend, fake_info
from ui.chat_view import SLOWEST_STREAM_FRAME_MS, STREAM_FRAME_MS
from ui.conversation_list import ID_ROLE
from ui.panels.docks import FRAME_MS, SLOWEST_FRAME_MS, shown


def send_and_wait(qtbot, parts, text: str) -> list:
    events: list = []
    parts.window.events_received.connect(events.extend)
    parts.window.settings_panel.set_settings(
        GenerationSettings(greedy=True, max_new_tokens=12, ignore_eos=True)
    )
    assert parts.window.send(text)
    qtbot.waitUntil(lambda: any(isinstance(e, Finished) for e in events), timeout=30000)
    parts.internals.redraw(force=True)
    return events


def show_attention(qtbot, parts) -> None:
    """The attention panel on screen: only then do the engine's rows cross (the view pulls
    what it draws, docs/view-contract.md)."""
    parts.internals.docks["attention"].raise_()
    qtbot.waitUntil(lambda: shown(parts.internals.attention))
    qtbot.waitUntil(lambda: bool(parts.worker.watching.layers))


def test_a_real_generation_fills_every_panel_with_its_events(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    show_attention(qtbot, parts)
    events = send_and_wait(qtbot, parts, "Hello there")
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    tokens = [e for e in events if isinstance(e, Token)]
    internals, info = parts.internals, parts.window.info
    assert len(tokens) == 12

    _x, kv = internals.kv_cache.curve.getData()
    assert kv[-1] == tokens[-1].kv_bytes  # the curve ends at the last event's bytes

    _x, steps = internals.timing.step_curve.getData()
    np.testing.assert_array_equal(steps, [t.seconds for t in tokens[1:]])  # one per step

    layer = internals.attention.selected_layer
    assert layer in prefill.attention  # the watched layers reached the engine
    panel = internals.attention  # the heads' tiles of its mosaic, colour scale undone
    stack = np.stack([panel.head_tile(head) for head in panel.slots])
    keys = prefill.prompt_tokens + len(tokens) - 1
    # The prompt's rows, then a row per step whose rows crossed (the latest at each frame,
    # and always the last step's before the reply's end)
    latest = [e for e in events if isinstance(e, StepRows) and e.latest]
    assert latest and latest[-1].step == tokens[-1].index
    rows = prefill.prompt_tokens + len(latest)
    assert stack.shape == (info.heads, rows, keys)  # heads x query tokens x key tokens
    np.testing.assert_allclose(stack[:, : prefill.prompt_tokens, : prefill.prompt_tokens],
                               prefill.attention[layer], rtol=1e-6)  # fmt: skip
    for index, step in enumerate(latest):
        row = stack[:, prefill.prompt_tokens + index, :]
        np.testing.assert_allclose(row[:, : step.attention[layer].shape[1]],
                                   step.attention[layer], rtol=1e-6)  # fmt: skip
    np.testing.assert_allclose(stack[:, -1, :], latest[-1].attention[layer], rtol=1e-6)


def test_a_long_prompt_sends_only_the_rows_the_attention_panel_keeps(qtbot, build, tiny_loader):
    """The engine's prompt block has the view's rows, not ProbeSettings' default 512: the rows
    past them were sent only to be dropped (half of what crossed from the engine). They cross
    pooled at the panel's grid, the rows themselves before the reply's end."""
    parts = build(tiny_loader)
    show_attention(qtbot, parts)
    kept = parts.internals.state.max_attention_rows
    probes = parts.window.probe_settings()
    assert probes.prefill_cells == parts.internals.state.max_attention_cells is not None
    events = send_and_wait(qtbot, parts, "tokens " * (kept + 100))
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    assert prefill.prompt_tokens > kept + 100
    layer = parts.internals.attention.selected_layer
    assert layer not in prefill.attention  # the panel said its grid: the prompt crossed pooled
    cells = next(e for e in events if isinstance(e, PromptCells)).attention[layer]
    assert cells.queries == kept
    block = next(e for e in events if isinstance(e, StepRows) and e.prompt).attention[layer]
    assert block.shape[1] == kept  # [heads, queries, keys]
    rows = parts.internals.state.attention[layer]  # what the attention panel draws from
    prompt_rows = int((rows.positions < prefill.prompt_tokens).sum())
    assert 0 < prompt_rows < kept  # the first tokens' rows pushed the older half out
    keys = prefill.prompt_tokens
    kept_rows = rows.matrix()[:, :prompt_rows, :keys]  # filled with the rows that came
    np.testing.assert_array_equal(kept_rows, block[:, -prompt_rows:])


def test_every_message_is_stored_with_its_stats_and_reopens(qtbot, build, tiny_loader, tmp_path):
    parts = build(tiny_loader)
    events = send_and_wait(qtbot, parts, "First question")
    finished = events[-1]
    shown = parts.window.conversation()
    parts.window.close()
    parts.shutdown()

    store = ConversationStore(tmp_path / "chats.sqlite3")
    (conversation,) = store.list_conversations()
    stored = store.messages(conversation.id)
    assert [(m.role, m.text) for m in stored] == [(m.role, m.content) for m in shown]
    reply = stored[-1]
    assert reply.complete and reply.stats["generated_tokens"] == finished.generated_tokens
    assert reply.stats["finish_reason"] == "length"
    store.close()

    again = build(tiny_loader)  # the last conversation reopens on start
    assert again.window.conversation() == shown
    assert again.controller.conversation_id == conversation.id


def test_closing_mid_reply_saves_the_partial_reply_as_incomplete(qtbot, build, tmp_path):
    import threading

    gate = threading.Semaphore(0)
    backend = FakeBackend(gate=gate)
    parts = build(backend.load, backend.make_session)
    assert parts.window.send("Tell me a long story")
    for _ in range(3):
        gate.release()
    qtbot.waitUntil(lambda: "".join(parts.window.chat.reply_text()) != "", timeout=5000)
    shown = parts.window.chat.reply_text()
    parts.window.close()  # mid-reply: the worker stops, the partial text is kept
    parts.shutdown()
    assert not parts.worker.is_running()

    store = ConversationStore(tmp_path / "chats.sqlite3")
    (conversation,) = store.list_conversations()
    user, reply = store.messages(conversation.id)
    assert user.text == "Tell me a long story" and user.complete
    assert not reply.complete and reply.text == shown
    store.close()


def test_a_damaged_database_is_set_aside_and_the_window_says_so(qtbot, build, tmp_path):
    database = tmp_path / "chats.sqlite3"
    database.write_bytes(b"this is not a database" * 100)
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session, database=database)
    text = parts.window.chat.toPlainText()
    assert "damaged" in text and "kept aside" in text
    assert list(tmp_path.glob("chats.sqlite3.corrupt*"))
    assert parts.window.send("still works")


def test_a_database_that_cannot_be_opened_keeps_chats_in_memory_and_says_so(qtbot, build, tmp_path):
    """Its folder cannot be made (a file stands where it should be): the window opens, says
    why, and a chat goes on, kept until the window closes."""
    (tmp_path / "data").write_text("a file, not a folder")
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session, database=tmp_path / "data" / "chats.sqlite3")
    text = parts.window.chat.toPlainText()
    assert "cannot be used" in text and "until this window closes" in text
    assert parts.window.send("still works")
    qtbot.waitUntil(lambda: not parts.window.replying, timeout=30000)
    store = parts.controller.store
    (conversation,) = store.list_conversations()
    user, reply = store.messages(conversation.id)
    assert user.text == "still works" and reply.role == "assistant" and reply.text


def test_a_newer_glassboxs_database_is_left_as_it_is(qtbot, build, tmp_path):
    database = tmp_path / "chats.sqlite3"
    with ConversationStore(database) as store:
        store.create_conversation("kept for the newer version")
    with sqlite3.connect(database) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = database.read_bytes()
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session, database=database)
    assert "newer Glassbox" in parts.window.chat.toPlainText()
    assert parts.controller.store.list_conversations() == []  # this window's, in memory
    assert parts.window.send("a chat of its own")
    qtbot.waitUntil(lambda: not parts.window.replying, timeout=30000)
    assert database.read_bytes() == before and not list(tmp_path.glob("*.corrupt-*"))


def test_tokens_delivered_together_are_stored_and_shown_as_one_by_one(qtbot, build, monkeypatch):
    """A batch of tokens (one delivery of the worker) reaches the store and the chat as the
    same tokens delivered one at a time: the same saved text mid-reply and at its end."""
    monkeypatch.setattr(recorder, "ReplySaver", partial(ReplySaver, interval_s=0.0))  # each
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session)
    model = parts.window.conversation_model
    settings = GenerationSettings(max_new_tokens=len(REPLY) + 1)
    session = SyntheticSession(fake_info(), REPLY)
    prefill, *tokens, finished = session.generate([Message("user", "Hi")], settings)
    store = parts.controller.store
    saved = []
    for deliveries in ([[prefill, *tokens]], [[prefill], *[[token] for token in tokens]]):
        model.clear()  # a new chat, as New chat makes one
        model.add_user("Hi", settings, "fake")
        model.start_reply(settings, "fake")
        for batch in deliveries:
            model.apply_many(batch)
        conversation_id = parts.controller.conversation_id
        streaming = [(m.text, m.complete) for m in store.messages(conversation_id)]
        shown = parts.window.chat.reply_text()
        model.apply(finished)
        stored = [(m.text, m.complete) for m in store.messages(conversation_id)]
        saved.append((streaming, shown, stored))
    text = "".join(REPLY)
    assert (
        saved[0] == saved[1] == ([("Hi", True), (text, False)], text, [("Hi", True), (text, True)])
    )


def test_the_chat_and_the_deliveries_follow_the_panels_frame_rate(qtbot, build, tiny_loader):
    """Panels slowed to their slowest by the CPU budget: the chat streams text and the
    engine's events come as often as the panels draw (twice a second); a teacher stepping:
    both at once."""
    parts = build(tiny_loader)
    parts.internals.frame_interval_changed.emit(SLOWEST_FRAME_MS)
    assert parts.window.chat.stream_interval_ms == SLOWEST_STREAM_FRAME_MS == SLOWEST_FRAME_MS
    assert parts.worker.drain_interval == SLOWEST_DRAIN_MS == SLOWEST_FRAME_MS
    parts.internals.frame_interval_changed.emit(FRAME_MS)
    assert parts.window.chat.stream_interval_ms == STREAM_FRAME_MS
    assert parts.worker.drain_interval == FRAME_MS


def test_a_message_and_a_reply_move_their_conversation_up_without_rebuilding_the_list(
    qtbot, build, monkeypatch
):
    """An old conversation written to goes to the top of the sidebar as the store orders it;
    the other rows stay the rows they were (the whole list is not built again each time).
    With a search typed, the list is searched again."""
    monkeypatch.setattr(recorder, "ReplySaver", partial(ReplySaver, interval_s=0.0))
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session)
    store, sidebar = parts.controller.store, parts.controller.sidebar
    old = [store.create_conversation(f"old {i}", model="fake", system_prompt="", settings=None)
           for i in range(6)]  # fmt: skip
    parts.controller.refresh()
    parts.controller.open(old[2])
    rows = [sidebar.list.item(i) for i in range(sidebar.list.count())]
    items = {item.data(ID_ROLE): item for item in rows}
    model = parts.window.conversation_model
    settings = GenerationSettings(max_new_tokens=len(REPLY) + 1)
    prefill, *tokens, finished = SyntheticSession(fake_info(), REPLY).generate(
        [Message("user", "Hi")], settings
    )
    model.add_user("Hi", settings, "fake")
    assert sidebar.ids() == [c.id for c in store.list_conversations()]
    assert sidebar.ids()[0] == old[2]
    model.start_reply(settings, "fake")
    model.apply_many([prefill, *tokens, finished])
    assert sidebar.ids() == [c.id for c in store.list_conversations()]
    assert sidebar.current_id() == old[2]
    kept = [sidebar.list.item(i) for i in range(1, sidebar.list.count())]
    assert kept and all(item is items[item.data(ID_ROLE)] for item in kept)  # not built again

    sidebar.search_field.setText("old 4")
    qtbot.waitUntil(lambda: sidebar.ids() == [old[4]])
    model.add_user("And again", settings, "fake")  # old 2 matches no search: still hidden
    assert sidebar.ids() == [c.id for c in store.search("old 4")] == [old[4]]
