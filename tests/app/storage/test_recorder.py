"""The one recorder of a conversation into the store, as the window and the terminal use it."""

from __future__ import annotations

from app.bench.synthetic import SyntheticSession, model_info
from app.storage.recorder import TITLE_CHARS, ConversationRecorder, title_from
from app.storage.store import ConversationStore
from engine.events import ENGINE_STOPPED, Failed, Finished
from engine.settings import GenerationSettings, Message

SETTINGS = GenerationSettings(max_new_tokens=4)


def events(pieces=("One", " two", " three")) -> list:
    session = SyntheticSession(model_info(layers=2), pieces)
    return list(session.generate([Message("user", "Count")], SETTINGS))


def record_all(recorder: ConversationRecorder, reply: list) -> None:
    for event in reply:
        recorder.record(event, model="m", settings=SETTINGS)


def test_titles_are_the_first_message_on_one_line():
    assert title_from("  Where do\n rivers   begin? ") == "Where do rivers begin?"
    assert len(title_from("word " * 40)) == TITLE_CHARS
    assert title_from(" \n ") == "New chat"


def test_a_conversation_is_created_with_its_first_message_and_replies_complete(tmp_path):
    with ConversationStore(tmp_path / "c.sqlite3") as store:
        recorder = ConversationRecorder(store)
        recorder.add_user("Count\nplease", model="m", system_prompt="Be brief.", settings=SETTINGS)
        reply = events()
        record_all(recorder, reply[:-1])
        assert recorder.recording_reply  # begun at prefill, incomplete while it streams
        (_user, streaming) = store.messages(recorder.conversation_id)
        assert not streaming.complete
        record_all(recorder, reply[-1:])
        conversation = store.conversation(recorder.conversation_id)
        assert (conversation.title, conversation.system_prompt) == ("Count please", "Be brief.")
        user, answer = store.messages(recorder.conversation_id)
        assert (user.text, user.settings["max_new_tokens"]) == ("Count\nplease", 4)
        assert (answer.text, answer.complete, answer.model) == ("One two three", True, "m")
        assert answer.stats["generated_tokens"] == 3 and answer.stats["finish_reason"] == "eos"

        recorder.truncate(1)  # regenerate: the reply goes
        assert [m.role for m in store.messages(recorder.conversation_id)] == ["user"]


def test_a_reply_cut_off_with_its_engine_or_interrupted_stays_incomplete(tmp_path):
    with ConversationStore(tmp_path / "c.sqlite3") as store:
        recorder = ConversationRecorder(store)
        recorder.add_user("Count", model="m", system_prompt="", settings=SETTINGS)
        prefill, first, *_ = events()
        record_all(recorder, [prefill, first, Failed("killed", ENGINE_STOPPED)])
        record_all(recorder, [Finished("error", "One", *[0] * 8)])
        assert [(m.text, m.complete) for m in store.messages(recorder.conversation_id)][1:] == [
            ("One", False)
        ]
        record_all(recorder, events()[:2])
        recorder.interrupted()  # quitting mid-reply: what streamed is saved now
        assert store.messages(recorder.conversation_id)[-1].text == "One"
        recorder.open(None)
        assert recorder.conversation_id is None and not recorder.recording_reply


def test_a_reply_that_never_reached_the_model_is_kept_only_where_asked(tmp_path):
    refused = [Failed("too long", "ContextFull"), Finished("context_full", "", *[0] * 8)]
    with ConversationStore(tmp_path / "c.sqlite3") as store:
        for keep in (False, True):
            recorder = ConversationRecorder(store, keep_unanswered=keep)
            recorder.add_user("Long", model="m", system_prompt="", settings=SETTINGS)
            record_all(recorder, refused)
            roles = [m.role for m in store.messages(recorder.conversation_id)]
            assert roles == (["user", "assistant"] if keep else ["user"])
