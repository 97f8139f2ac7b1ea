"""The conversation model alone, without Qt: its states, and the changes it announces in order."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from app.bench.synthetic import SyntheticSession, model_info
from engine.events import ENGINE_STOPPED, Failed, Tally
from engine.settings import GenerationSettings, Message
from tests.ui.fakes import fake_info
from ui.conversation import (
    Added,
    Conversation,
    Entry,
    ReplyAbandoned,
    ReplyEnded,
    ReplyEvent,
    ReplyStarted,
    ReplyState,
    ReplyTokens,
    Reset,
    Truncated,
)

SETTINGS = GenerationSettings(max_new_tokens=3)


def recorded(conversation: Conversation) -> list:
    changes: list = []
    conversation.subscribe(changes.append)
    return changes


def reply_events(pieces=("Hi", " there")) -> list:
    session = SyntheticSession(fake_info(), pieces)
    settings = GenerationSettings(max_new_tokens=max(len(pieces) + 1, SETTINGS.max_new_tokens))
    return list(session.generate([Message("user", "Hello")], settings))


def test_a_reply_goes_from_sent_to_streaming_to_finished_and_becomes_a_message():
    conversation = Conversation()
    changes = recorded(conversation)
    conversation.add_user("Hello", SETTINGS, "fake")
    conversation.start_reply(SETTINGS, "fake")
    assert conversation.state is ReplyState.SENT and conversation.replying
    prefill, *tokens, finished = reply_events()
    conversation.apply(prefill)
    assert conversation.state is ReplyState.STREAMING
    for token in tokens:
        conversation.apply(token)
    assert conversation.reply.text == "Hi there" and conversation.messages() == [
        Message("user", "Hello")
    ]
    conversation.apply(finished)

    assert conversation.state is ReplyState.FINISHED and not conversation.replying
    assert conversation.messages() == [Message("user", "Hello"), Message("assistant", "Hi there")]
    reply = conversation.entries[-1]
    assert (reply.model, reply.settings, reply.complete) == ("fake", SETTINGS, True)
    assert reply.stats["generated_tokens"] == 2 and reply.stats["finish_reason"] == "eos"
    # Every change in the order it happened; the Finished event before the reply's end.
    kinds = [type(change) for change in changes]
    assert kinds == [Added, ReplyStarted, ReplyEvent, *[ReplyTokens] * 2, ReplyEvent, ReplyEnded]
    assert changes[-2].event is finished and changes[-1].entry is reply
    assert [change.tokens for change in changes[3:5]] == [(tokens[0],), (tokens[1],)]


def test_tokens_delivered_together_are_one_change_with_the_same_text():
    """A batch of tokens is taken in as N single tokens are (every piece, the same text and
    message) but announced once per run of tokens, so its listeners work once per batch."""
    pieces = ("Hi", " there", ",", " you", "\n", "ok")
    prefill, *tokens, finished = reply_events(pieces)
    one_by_one, together = Conversation(), Conversation()
    changes = recorded(together)
    for conversation in (one_by_one, together):
        conversation.add_user("Hello", SETTINGS, None)
        conversation.start_reply(SETTINGS, None)
    for event in (prefill, *tokens):
        one_by_one.apply(event)
    together.apply_many([prefill, *tokens[:4]])
    together.apply_many(tokens[4:])
    assert together.reply.parts == one_by_one.reply.parts == list(pieces)
    runs = [change for change in changes if isinstance(change, ReplyTokens)]
    assert [run.tokens for run in runs] == [tuple(tokens[:4]), tuple(tokens[4:])]
    assert "".join(run.text for run in runs) == "".join(pieces)

    one_by_one.apply(finished)
    together.apply_many([finished, tokens[0]])  # what follows the end is not the reply's
    assert together.entries == one_by_one.entries
    assert together.entries[-1].text == "".join(pieces)
    assert isinstance(changes[-1], ReplyEnded)


def test_a_reply_cut_off_with_its_engine_is_kept_incomplete_and_fails():
    conversation = Conversation()
    conversation.add_user("Hello", SETTINGS, None)
    conversation.start_reply(SETTINGS, None)
    prefill, first, *_ = reply_events()
    conversation.apply(prefill)
    conversation.apply(first)
    conversation.apply(Failed("The engine was killed", ENGINE_STOPPED))
    conversation.apply(Tally(started=0.0, generated=1).finished("error", "Hi"))
    assert conversation.state is ReplyState.FAILED
    assert conversation.entries[-1] == Entry(
        "assistant", "Hi", None, SETTINGS, conversation.entries[-1].stats, complete=False
    )


def test_an_abandoned_reply_is_not_added_and_its_late_events_are_ignored():
    conversation = Conversation()
    changes = recorded(conversation)
    conversation.add_user("Hello", SETTINGS, None)
    conversation.start_reply(SETTINGS, None)
    prefill, *rest = reply_events()
    conversation.apply(prefill)
    conversation.clear()  # New chat mid-reply
    for event in rest:
        conversation.apply(event)
    assert conversation.entries == () and conversation.state is ReplyState.IDLE
    assert [type(c) for c in changes][-2:] == [ReplyAbandoned, Reset]


def test_waiting_for_the_model_and_regenerating():
    conversation = Conversation()
    changes = recorded(conversation)
    conversation.add_user("Hello", SETTINGS, None)
    conversation.wait_for_model(SETTINGS)
    assert conversation.state is ReplyState.WAITING and not conversation.replying
    assert conversation.stop_waiting() == SETTINGS and conversation.state is ReplyState.IDLE
    assert conversation.stop_waiting() is None

    conversation.load([Entry("user", "Q"), Entry("assistant", "A1"), Entry("assistant", "A2")])
    conversation.drop_last_reply()
    assert conversation.messages() == [Message("user", "Q")]
    assert isinstance(changes[-1], Truncated) and changes[-1].entries == conversation.entries
    conversation.drop_last_reply()  # nothing after the user's message: nothing announced
    assert isinstance(changes[-1], Truncated) and len(changes) == 3


def test_the_model_loads_without_qt():
    code = (
        "import sys, ui.conversation, ui.reply_stats\n"
        "qt = sorted(m for m in sys.modules if m.split('.')[0] in"
        " ('PySide6', 'shiboken6', 'pyqtgraph', 'app'))\n"
        "print('loaded:', qt)\n"
    )
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0 and "loaded: []" in result.stdout, result.stderr


def test_model_info_factory_changes_only_what_is_asked():
    info = model_info(layers=2, name="two")
    assert (info.layers, info.name, info.heads) == (2, "two", model_info().heads)
