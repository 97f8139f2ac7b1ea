"""Input that should hurt nothing: a message far past the context, emoji and right-to-left
text, blank messages, Stop pressed twice, a model switch or a failed load mid-conversation,
and sampling values out of range. The whole window as `glassbox` builds it, with a tiny real
model where the engine matters and the fake backend where it does not."""

from __future__ import annotations

import threading

import pytest
from PySide6.QtCore import Qt

from engine.events import Failed, Finished, PrefillDone
from engine.settings import GenerationSettings, LoadRequest, Message, SettingsError
from tests.ui.fakes import REPLY, FakeBackend
from ui.input_box import EMPTY_MESSAGE
from ui.settings_panel import SettingsPanel

GREEDY = GenerationSettings(greedy=True, max_new_tokens=12, ignore_eos=True)


@pytest.fixture
def gated(build):
    """The fake backend, one token per gate release, in an assembled window."""
    backend = FakeBackend(gate=threading.Semaphore(0))
    return backend, build(backend.load, backend.make_session)


def collect(parts) -> list:
    events: list = []
    parts.window.events_received.connect(events.extend)
    return events


def finished(events: list) -> list[Finished]:
    return [e for e in events if isinstance(e, Finished)]


def reply(qtbot, parts, text: str, settings: GenerationSettings = GREEDY) -> list:
    """Send `text` and wait until its reply has ended and the worker is idle; its events."""
    events = collect(parts)
    parts.window.settings_panel.set_settings(settings)
    assert parts.window.send(text)
    wait_idle(qtbot, parts)
    return events


def wait_idle(qtbot, parts) -> None:
    window = parts.window
    qtbot.waitUntil(lambda: not window.replying and not window.backend.busy, timeout=30000)


def stored(parts) -> list:
    """The open conversation as the store holds it."""
    controller = parts.controller
    return controller.store.messages(controller.conversation_id)


def test_a_100k_character_message_is_refused_for_the_context_and_the_chat_goes_on(
    qtbot, build, tiny_loader
):
    parts = build(tiny_loader)
    window = parts.window
    assert window.info.max_context == 2048
    long = ("All work and no play makes Jack a dull boy. " * 2300)[:100_000]

    events = reply(qtbot, parts, long)
    (end,) = finished(events)
    (failed,) = [e for e in events if isinstance(e, Failed)]
    assert end.reason == "context_full" and end.generated_tokens == 0
    assert failed.error_type == "ContextFull" and "Shorten it" in failed.message
    assert not any(isinstance(e, PrefillDone) for e in events)  # nothing reached the model
    assert failed.message in window.chat.toPlainText()  # said in the chat, not only the status
    assert window.chat.messages()[0] == Message("user", long)
    user, empty_reply = stored(parts)  # the message is kept; the refusal left an empty reply
    assert (user.role, user.text, user.complete) == ("user", long, True)
    assert (empty_reply.role, empty_reply.text) == ("assistant", "")

    events = reply(qtbot, parts, "Hello again")
    (prefill,) = [e for e in events if isinstance(e, PrefillDone)]
    (end,) = finished(events)
    assert end.reason == "length" and end.generated_tokens == 12
    assert prefill.dropped_messages == 2 and prefill.prompt_tokens < 100
    assert "oldest messages were left out" in window.chat.toPlainText()
    *_, user, answer = stored(parts)
    assert (user.text, answer.text, answer.complete) == ("Hello again", end.text, True)
    assert answer.stats["finish_reason"] == "length"


def test_emoji_and_right_to_left_text_arrive_exactly(qtbot, build, tiny_loader, tokenizer):
    text = "مرحبا 👋🏽 שלום 👩‍👩‍👧"
    parts = build(tiny_loader)
    window = parts.window
    events = collect(parts)
    window.settings_panel.set_settings(GREEDY)
    window.input.setPlainText(text)
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    wait_idle(qtbot, parts)

    assert window.chat.messages()[0] == Message("user", text)
    assert text in window.chat.toPlainText()
    (prefill,) = [e for e in events if isinstance(e, PrefillDone)]
    prompt = tokenizer.decode(prefill.prompt_token_ids)
    assert f"user\n{text}<|im_end|>" in prompt  # the engine was given these very characters
    user, answer = stored(parts)
    assert user.text == text and answer.complete
    conversation = parts.controller.store.conversation(parts.controller.conversation_id)
    assert conversation.title == text


def test_blank_messages_are_refused_with_a_reason_and_nothing_is_stored(qtbot, build):
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session)
    window = parts.window
    window.input.setPlainText("   \n\t  \n")
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert window.statusBar().currentMessage() == EMPTY_MESSAGE
    assert window.input.toPlainText() == "   \n\t  \n"  # left to edit

    window.statusBar().clearMessage()
    assert not window.send(" \u3000\n ")  # the window itself refuses, not only the box
    assert window.statusBar().currentMessage() == EMPTY_MESSAGE
    assert backend.session.calls == [] and window.chat.messages() == []
    assert window.conversation() == [] and parts.controller.conversation_id is None
    assert parts.controller.store.list_conversations() == []


def test_stop_pressed_twice_ends_the_reply_once(qtbot, gated):
    backend, parts = gated
    window = parts.window
    events = collect(parts)
    assert window.send("Tell me a long story")
    backend.gate.release(2)
    qtbot.waitUntil(lambda: window.chat.reply_text() == "".join(REPLY[:2]), timeout=5000)
    window.stop_action.trigger()
    window.stop_action.trigger()  # Esc again before the reply has ended
    wait_idle(qtbot, parts)

    (end,) = finished(events)
    assert end.reason == "cancelled" and end.text == "".join(REPLY[:2])
    assert not any(isinstance(e, Failed) for e in events)
    assert window.statusBar().currentMessage() == "Stopped."
    assert "stopped" in window.chat.toPlainText() and "error" not in window.chat.toPlainText()
    _user, partial = stored(parts)
    assert (partial.text, partial.complete) == (end.text, True)
    assert partial.stats["finish_reason"] == "cancelled"

    backend.gate.release(len(REPLY))
    (end,) = finished(reply(qtbot, parts, "Go on"))
    assert end.reason == "eos" and end.text == "".join(REPLY)


def test_loading_another_model_mid_reply_ends_it_and_keeps_what_streamed(qtbot, gated):
    backend, parts = gated
    window = parts.window
    events = collect(parts)
    assert window.send("Tell me a long story")
    backend.gate.release(3)
    qtbot.waitUntil(lambda: window.chat.reply_text() == "".join(REPLY[:3]), timeout=5000)
    with qtbot.waitSignal(window.model_changed, timeout=5000):
        window.load_model(LoadRequest(spec="other-model"))
    wait_idle(qtbot, parts)

    (end,) = finished(events)  # the reply ended before the new model came in
    assert end.reason == "cancelled" and end.text == "".join(REPLY[:3])
    assert window.info.name == "other-model" and backend.session.info.name == "other-model"
    partial = Message("assistant", end.text)
    assert window.conversation() == [Message("user", "Tell me a long story"), partial]
    _user, kept = stored(parts)  # stored complete, its stats saying it was cancelled
    assert (kept.text, kept.complete, kept.stats["finish_reason"]) == (end.text, True, "cancelled")
    assert kept.model == "tiny"

    backend.gate.release(len(REPLY))
    (end,) = finished(reply(qtbot, parts, "And now?"))
    assert end.reason == "eos"
    assert backend.session.calls[-1][-2:] == (partial, Message("user", "And now?"))
    assert stored(parts)[-1].model == "other-model"


def test_a_failed_load_leaves_the_previous_model_in_use(qtbot, build):
    backend = FakeBackend()
    parts = build(backend.load, backend.make_session)
    window = parts.window
    with qtbot.waitSignal(window.backend.load_failed, timeout=5000):
        window.load_model(LoadRequest(spec="broken"))
    wait_idle(qtbot, parts)

    assert window.info.name == "tiny" and len(backend.sessions) == 1
    assert "Could not load the model" in window.chat.toPlainText()
    assert "Still using tiny" in window.statusBar().currentMessage()
    (end,) = finished(reply(qtbot, parts, "Still there?"))
    assert end.reason == "eos" and end.text == "".join(REPLY)
    assert backend.session.calls == [(Message("user", "Still there?"),)]


def test_the_settings_panel_cannot_hold_invalid_sampling_values(qtbot):
    panel = SettingsPanel()
    qtbot.addWidget(panel)
    temperature, top_p = panel._temperature, panel._top_p
    for box, value, clamped in (
        (temperature, 0.0, 0.01),
        (temperature, -2.0, 0.01),
        (temperature, 99.0, 5.0),
        (top_p, 0.0, 0.01),
        (top_p, -0.5, 0.01),
        (top_p, 1.5, 1.0),
    ):
        box.setValue(value)
        assert box.value() == pytest.approx(clamped)
    assert panel.settings().temperature == pytest.approx(5.0)
    assert panel.settings().top_p == pytest.approx(1.0)

    # Typed: a minus sign or a digit past the maximum is not taken; 0 reverts on Enter.
    for box, typed, shown, value in (
        (temperature, "-0", "0", 0.5),
        (temperature, "7", "0.50", 0.5),
        (top_p, "-0", "0", 0.5),
        (top_p, "0.00", "0.00", 0.5),
        (top_p, "1.5", "1.", 1.0),
    ):
        box.setValue(0.5)
        box.lineEdit().selectAll()
        qtbot.keyClicks(box.lineEdit(), typed)
        assert box.lineEdit().text() == shown
        qtbot.keyClick(box.lineEdit(), Qt.Key.Key_Return)
        assert box.value() == pytest.approx(value)
    settings = panel.settings()
    assert settings.temperature == pytest.approx(0.5) and settings.top_p == pytest.approx(1.0)


@pytest.mark.parametrize(
    "values, words",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.01}, "top-p"),
        ({"top_k": -1}, "top-k"),
        ({"repetition_penalty": 0.0}, "repetition penalty"),
        ({"max_new_tokens": 0}, "max new tokens"),
        ({"context_policy": "truncate"}, "context policy"),
    ],
)
def test_generation_settings_reject_out_of_range_values(values, words):
    with pytest.raises(SettingsError, match=words):
        GenerationSettings(**values)
