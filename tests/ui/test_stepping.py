"""A teacher's pace in the window: pause after prefill, Next token, Play slowly, Resume, Stop,
and a token clicked in one panel selecting its step in every panel."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt, QUrl

from engine.events import Finished
from tests.ui.fakes import FakeBackend
from ui.panels.state.explain import kv_line
from ui.panels.tokens import SELECTED

LONG = tuple(f" w{i}" for i in range(40))


@pytest.fixture
def parts(build):
    backend = FakeBackend(pieces=LONG)
    parts = build(backend.load, backend.make_session)
    parts.backend = backend
    window = parts.window
    window.settings_panel.set_pause_after_prefill(True)
    parts.internals.docks["tokens"].raise_()
    return parts


def generated(parts) -> int:
    return parts.internals.state.trail.generated


def test_a_reply_holds_after_its_prefill_and_steps_a_token_per_press(parts, qtbot):
    window, internals = parts.window, parts.internals
    assert window.send("Tell me")
    qtbot.waitUntil(lambda: parts.backend.session.pacer.pace.waiting, timeout=5000)
    assert window.pace.mode == "paused" and "paused" in window.pace.state_label.text()
    assert generated(parts) == 0 and internals.tokens.shown == internals.state.prompt_tokens
    window.pace.next_action.trigger()
    qtbot.waitUntil(lambda: internals.tokens.shown == internals.state.prompt_tokens + 1)
    qtbot.keyClick(window, Qt.Key.Key_F10)  # the shortcut
    qtbot.waitUntil(lambda: generated(parts) == 2, timeout=5000)
    qtbot.waitUntil(lambda: parts.backend.session.pacer.pace.waiting, timeout=5000)
    assert generated(parts) == 2  # held again after each step
    # While stepping, each panel says what the latest step did.
    internals.redraw(force=True)
    assert internals.kv_cache.step_line.text() == kv_line(internals.state)
    assert internals.kv_cache.step_line.text().startswith("Step 1 appended one key")
    window.pace.play_action.trigger()
    assert window.pace.mode == "slow"
    qtbot.waitUntil(lambda: generated(parts) >= 4, timeout=10000)
    window.pace.resume_action.trigger()
    qtbot.waitUntil(lambda: not window.replying, timeout=10000)
    assert generated(parts) == len(LONG)


def test_stop_ends_a_held_reply(parts, qtbot):
    window = parts.window
    assert window.send("Tell me")
    qtbot.waitUntil(lambda: parts.backend.session.pacer.pace.waiting, timeout=5000)
    with qtbot.waitSignal(window.events_received, timeout=5000) as ended:
        window.stop_action.trigger()
    batches = [ended.args[0]]
    qtbot.waitUntil(lambda: not window.replying, timeout=5000)
    assert generated(parts) == 0
    finished = parts.internals.state.reply.finished
    assert isinstance(finished, Finished) and finished.reason == "cancelled", batches


def test_a_token_clicked_anywhere_selects_its_step_in_every_panel(parts, qtbot):
    window, internals = parts.window, parts.internals
    window.settings_panel.set_pause_after_prefill(False)
    assert window.send("Tell me")
    qtbot.waitUntil(lambda: not window.replying, timeout=10000)
    state = internals.state
    prompt = state.prompt_tokens
    internals.tokens.chips.anchorClicked.emit(QUrl(f"token:{prompt + 5}"))  # a Tokens chip
    internals.redraw(force=True)
    assert state.selected_step == 5
    assert internals.next_token.step == 5
    assert internals.timing.steps_plot.marker == 5.0
    assert internals.kv_cache.plot_widget.marker == float(prompt + 5)
    assert internals.kv_cache.step_line.text().startswith("Step 5 ")
    assert internals.timing.step_line.text().startswith("Step 5 took")
    assert internals.tokens.chip_format(prompt + 5).background().color() == SELECTED
    # A token of the reply in the next-token panel's strip selects it everywhere too.
    internals.next_token.tokens.anchorClicked.emit(QUrl("step:7"))
    internals.redraw(force=True)
    assert state.selected == prompt + 7
    assert internals.tokens.chip_format(prompt + 7).background().color() == SELECTED
    assert internals.tokens.chip_format(prompt + 5).background().color() != SELECTED
    assert internals.timing.steps_plot.marker == 7.0


def test_the_toolbar_says_held_only_once_the_engine_holds(parts, qtbot):
    window = parts.window
    pace, label = window.pace, window.pace.state_label
    assert not pace.held
    assert window.send("Tell me")
    qtbot.waitUntil(lambda: pace.held, timeout=5000)
    assert parts.backend.session.pacer.pace.waiting  # the engine's own word
    assert label.text() == "‖ paused after the prefill: Next token (F10) steps"
    pace.next_action.trigger()
    qtbot.waitUntil(lambda: label.text().startswith("‖ paused after step 0:"), timeout=5000)
    assert pace.held and generated(parts) == 1  # the step's token arrived before the hold
    pace.resume_action.trigger()
    qtbot.waitUntil(lambda: not window.replying, timeout=10000)
    assert not pace.held and label.text() == "full speed"


def test_a_token_clicked_in_the_held_reply_selects_its_step(parts, qtbot):
    window, internals = parts.window, parts.internals
    state, chat = internals.state, window.chat
    assert window.send("Tell me")
    qtbot.waitUntil(lambda: window.pace.held, timeout=5000)
    for steps in range(1, 5):
        window.pace.next_action.trigger()
        qtbot.waitUntil(lambda steps=steps: generated(parts) == steps and window.pace.held)
    chat.flush()
    text = chat.toPlainText()
    start = text.rindex(LONG[0])  # the reply's text: " w0 w1 w2 w3"
    assert text[start:].startswith("".join(LONG[:4]))
    cursor = chat.textCursor()
    # A character inside " w2" (step 2), found in the document as a user would click it.
    cursor.setPosition(chat.document().find(LONG[2]).selectionStart() + 2)
    point = chat.cursorRect(cursor).center()
    qtbot.mouseClick(chat.viewport(), Qt.MouseButton.LeftButton, pos=point)
    assert state.selected == state.prompt_tokens + 2 and state.selected_step == 2
    internals.redraw(force=True)
    assert internals.timing.steps_plot.marker == 2.0
    assert chat.step_at(0) is None  # before the reply: no step
    window.stop_action.trigger()
    qtbot.waitUntil(lambda: not window.replying, timeout=5000)
