"""Each token's confidence: the Next token probe's probability of the chosen token, kept with
the reply in the store (a column of its own: the stats stay the Finished's numbers), reloaded,
and written into both exports."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from app.storage.export import to_json, to_markdown
from app.storage.recorder import ConversationRecorder
from app.storage.store import ConversationStore, JsonArray
from engine.events import Peaks, Token
from engine.generate.session import ChatSession
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.models import make_tiny
from ui.confidence import confidences, describe, plain_confidences, tint
from ui.conversation import Conversation, ReplyEvent, ReplyTokens
from ui.reply_stats import finished_stats

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")
SETTINGS = GenerationSettings(max_new_tokens=6, ignore_eos=True, greedy=True)


@pytest.fixture(scope="module")
def reply(tokenizer) -> list:
    """A reply with 10 candidates a step."""
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    return list(session.generate([Message("user", "Hi")], SETTINGS, ProbeSettings(top_k=10)))


def expected(token: Token) -> float | None:
    """The probe's probability of the chosen token, straight from its candidates."""
    for candidate in token.top_k:
        if candidate.token_id == token.token_id:
            return candidate.prob
    return None


def test_confidence_is_the_probes_probability_and_survives_the_store(tmp_path, reply):
    tokens = [e for e in reply if isinstance(e, Token)]
    with ConversationStore(tmp_path / "c.sqlite3") as store:
        recorder = ConversationRecorder(store)
        recorder.add_user("Hi", model="m", system_prompt="", settings=SETTINGS)
        for event in reply:
            recorder.record(event, model="m", settings=SETTINGS)
        conversation_id = recorder.conversation_id
    with ConversationStore(tmp_path / "c.sqlite3") as store:  # reopened: what was written
        _user, answer = store.messages(conversation_id)
        kept = confidences(answer.confidence)
        assert set(answer.stats) == set(finished_stats(reply[-1]))  # the stats as they were
        assert [k.text for k in kept] == [t.piece for t in tokens]
        assert [k.prob for k in kept] == [expected(t) for t in tokens]
        assert all(k.prob is not None for k in kept)  # greedy: each is the first candidate
        for item, token in zip(kept, tokens, strict=True):
            others = [(c.text, c.prob) for c in token.top_k if c.token_id != token.token_id]
            assert list(item.runners_up) == others[:3]
        document = json.loads(to_json(store.conversation(conversation_id), [_user, answer]))
        assert document["messages"][1]["confidence"] == answer.confidence
        markdown = to_markdown(store.conversation(conversation_id), [_user, answer])
        first = kept[0]
        assert "Token confidence" in markdown and f"`{first.text!r}` | {first.prob:.1%}" in markdown


def test_the_window_conversation_keeps_the_same_confidences(reply):
    conversation = Conversation()
    conversation.add_user("Hi", SETTINGS, "m")
    conversation.start_reply(SETTINGS, "m")
    conversation.apply_many(reply)
    entry = conversation.entries[-1]
    tokens = [e for e in reply if isinstance(e, Token)]
    assert [k.prob for k in confidences(entry.confidence)] == [expected(t) for t in tokens]


def test_the_window_stores_the_confidences_its_conversation_worked_out(tmp_path, reply):
    """The window's recorder takes each run's confidences from the conversation's change (not
    worked out twice): the store keeps what the terminal's recorder keeps from the tokens."""
    with ConversationStore(tmp_path / "c.sqlite3") as store:
        recorder = ConversationRecorder(store)
        recorder.add_user("Hi", model="m", system_prompt="", settings=SETTINGS)
        conversation = Conversation()
        runs: list[ReplyTokens] = []

        def record(change) -> None:  # as the window's controller does
            if isinstance(change, ReplyTokens):
                runs.append(change)
                recorder.record_tokens(change.tokens, change.confidences)
            elif isinstance(change, ReplyEvent):
                recorder.record(change.event, model="m", settings=SETTINGS)

        conversation.subscribe(record)
        conversation.add_user("Hi", SETTINGS, "m")
        conversation.start_reply(SETTINGS, "m")
        conversation.apply_many(reply)
        _user, answer = store.messages(recorder.conversation_id)
    assert runs and all(run.confidences for run in runs)
    assert answer.confidence == plain_confidences(t for t in reply if isinstance(t, Token))


def test_a_token_from_outside_the_candidates_has_no_probability(reply):
    token = next(e for e in reply if isinstance(e, Token))
    outside = replace(token, token_id=-1)
    (item,) = plain_confidences([outside, replace(token, top_k=())])  # no candidates: left out
    assert item[1] is None and len(item[2]) == 3


def test_a_reply_without_candidates_keeps_none_and_tint_and_hover_say_the_numbers():
    assert confidences([]) == ()
    assert tint(1.0)[3] == 0 and tint(0.0)[3] == 150 and tint(None)[3] == 150
    (item,) = confidences([[" sunny", 0.25, [[" warm", 0.125]]]])
    assert describe(item) == "' sunny': 25.0%\n  ' warm': 12.5%"


def test_a_database_of_the_previous_schema_gains_the_column_and_keeps_its_messages(tmp_path):
    import sqlite3

    from app.storage.store import MIGRATIONS

    path = tmp_path / "old.sqlite3"
    conn = sqlite3.connect(path)
    conn.executescript("".join(MIGRATIONS[:-1]) + f"PRAGMA user_version = {len(MIGRATIONS) - 1};")
    conn.execute("INSERT INTO conversations (title, created, updated) VALUES ('t', 1, 1)")
    conn.execute(
        "INSERT INTO messages (conversation_id, position, role, text, created)"
        " VALUES (1, 0, 'assistant', 'old reply', 1)"
    )
    conn.commit()
    conn.close()
    with ConversationStore(path) as store:
        (message,) = store.messages(1)
        assert (message.text, message.confidence) == ("old reply", [])


def test_confidences_encoded_run_by_run_are_the_whole_lists_json():
    """The recorder encodes each delivered run as it comes (JsonArray): the stored text is
    json.dumps of the whole list, empty runs and an empty reply included."""
    runs = [[["a", 0.5, [["b", 0.25]]]], [], [["c", None, []], ["é\n", 1.0, []]]]
    encoded = JsonArray()
    assert encoded.dumps() == json.dumps([])
    for run in runs:
        encoded.extend(run)
    assert encoded.dumps() == json.dumps([item for run in runs for item in run])
