"""Completion mode in the window: a switch per conversation, stored with it, that makes the
engine continue the text as written (no chat template)."""

from __future__ import annotations

from app.storage.store import ConversationStore
from engine.events import Finished, PrefillDone
from engine.settings import GenerationSettings
from ui.settings_panel import SettingsPanel


def test_the_switch_is_part_of_the_settings_and_only_a_click_announces_it(qtbot):
    panel = SettingsPanel()
    qtbot.addWidget(panel)
    flips: list[bool] = []
    panel.completion_toggled.connect(flips.append)
    assert panel.settings().completion is False
    panel.set_completion(True)  # showing a conversation's mode is not the user's flip
    assert panel.settings().completion is True and flips == []
    assert not panel._prompt.isEnabled()  # no template: the system prompt is not sent
    panel._completion.click()
    assert flips == [False] and panel.settings() == GenerationSettings()
    assert panel._prompt.isEnabled()


def send(qtbot, parts, text: str) -> PrefillDone:
    events: list = []
    parts.window.events_received.connect(events.extend)
    assert parts.window.send(text)
    qtbot.waitUntil(lambda: any(isinstance(e, Finished) for e in events), timeout=30000)
    qtbot.waitUntil(lambda: not parts.worker.busy, timeout=30000)  # ready for the next one
    parts.window.events_received.disconnect(events.extend)
    return next(e for e in events if isinstance(e, PrefillDone))


def test_a_completion_conversation_sends_its_text_as_written_and_keeps_its_mode(
    qtbot, build, tiny_loader, tokenizer, tmp_path
):
    parts = build(tiny_loader)
    panel = parts.window.settings_panel
    panel.set_settings(GenerationSettings(greedy=True, max_new_tokens=4, ignore_eos=True))
    panel._completion.click()
    prefill = send(qtbot, parts, "Today's weather is so")
    assert list(prefill.prompt_token_ids) == tokenizer("Today's weather is so")["input_ids"]
    first = parts.controller.conversation_id

    parts.window.new_chat()
    panel._completion.click()  # a new chat in chat mode goes through the template
    prefill = send(qtbot, parts, "Hello")
    assert len(prefill.prompt_token_ids) > len(tokenizer("Hello")["input_ids"])
    second = parts.controller.conversation_id

    parts.controller.open(first)  # reopening shows the conversation's own mode
    assert panel.settings().completion is True
    parts.controller.open(second)
    assert panel.settings().completion is False
    parts.controller.open(first)
    panel._completion.click()  # the user switches the open conversation to chat
    parts.window.close()
    parts.shutdown()
    with ConversationStore(tmp_path / "chats.sqlite3") as store:
        assert store.conversation(first).completion is False
        assert store.conversation(second).completion is False
