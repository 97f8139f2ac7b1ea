"""The chat tints each token of a reply by the probability the model gave it, with the
probability and the runners-up on hover; the switch in the View menu turns it on and off."""

from __future__ import annotations

import pytest

from engine.events import Peaks, Token
from engine.generate.session import ChatSession
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.models import make_tiny
from ui.chat_view import ChatView
from ui.confidence import describe, of_token, tint

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")
SETTINGS = GenerationSettings(max_new_tokens=5, ignore_eos=True, greedy=True)


@pytest.fixture(scope="module")
def reply(tokenizer) -> list:
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    return list(session.generate([Message("user", "Hi")], SETTINGS, ProbeSettings(top_k=10)))


def tinted_fragments(view: ChatView) -> list[tuple[str, str, int]]:
    """(text, tooltip, background alpha) of every fragment that has a tooltip."""
    found = []
    block = view.document().begin()
    while block.isValid():
        it = block.begin()
        while not it.atEnd():
            fragment = it.fragment()
            fmt = fragment.charFormat()
            if fmt.toolTip():
                found.append((fragment.text(), fmt.toolTip(), fmt.background().color().alpha()))
            it += 1
        block = block.next()
    return found


def test_each_token_is_tinted_by_its_probability_with_the_runners_up_on_hover(qtbot, reply):
    view = ChatView()
    qtbot.addWidget(view)
    conversation = view.conversation
    conversation.add_user("Hi", SETTINGS, "m")
    conversation.start_reply(SETTINGS, "m")
    conversation.apply_many(reply)
    assert tinted_fragments(view) == []  # off by default: Markdown
    view.show_confidence(True)
    tokens = [e for e in reply if isinstance(e, Token)]
    expected = [of_token(t) for t in tokens]
    fragments = tinted_fragments(view)
    # adjacent tokens with the same format merge into one fragment: compare token by token
    texts = [(c.piece, describe(e), tint(e.prob)[3]) for c, e in zip(tokens, expected, strict=True)]
    merged: list[tuple[str, str, int]] = []
    for text, tip, alpha in texts:
        if merged and merged[-1][1:] == (tip, alpha):
            merged[-1] = (merged[-1][0] + text, tip, alpha)
        else:
            merged.append((text, tip, alpha))
    assert fragments == merged
    view.show_confidence(False)
    assert tinted_fragments(view) == []


def test_the_view_menu_switch_tints_the_chat(qtbot, build, tiny_loader):
    parts = build(tiny_loader)
    window = parts.window
    window.settings_panel.set_settings(SETTINGS)
    finished = []
    window.events_received.connect(lambda events: finished.extend(events))
    assert window.send("Hi")
    qtbot.waitUntil(lambda: not parts.worker.busy and bool(finished), timeout=30000)
    assert window.confidence_action in window.view_menu.actions()
    window.confidence_action.setChecked(True)
    qtbot.waitUntil(lambda: bool(tinted_fragments(window.chat)))
    window.confidence_action.setChecked(False)
    assert tinted_fragments(window.chat) == []
