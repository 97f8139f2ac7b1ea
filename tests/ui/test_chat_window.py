"""The chat window against the real worker thread and a fake session that yields real events:
typing, streaming, stop, regenerate, new chat, model loading and closing mid-reply."""

from __future__ import annotations

import threading
import time

import pytest
from PySide6.QtCore import QCoreApplication, QEvent, QObject, Qt
from PySide6.QtWidgets import QDockWidget, QLabel

from app.bench.synthetic import BROKEN
from engine.events import Finished, PrefillDone, Tally, Token
from engine.settings import GenerationSettings, LoadRequest, Message
from tests.ui.fakes import REPLY
from ui.chat_view import ChatView
from ui.conversation import Conversation, Entry
from ui.main_window import human_count
from ui.model_picker import ModelPicker
from ui.settings_panel import SettingsPanel


def type_message(qtbot, window, text: str) -> None:
    qtbot.keyClicks(window.input, text)
    qtbot.keyClick(window.input, Qt.Key.Key_Return)


def shortcut(qtbot, window, key: Qt.Key, modifier=Qt.KeyboardModifier.NoModifier) -> None:
    """Press a key where the user would: in the message box of the active window."""
    window.activateWindow()
    qtbot.waitUntil(lambda: QCoreApplication.instance().activeWindow() is window, timeout=2000)
    qtbot.keyClick(window.input, key, modifier)


def wait_idle(qtbot, window) -> None:
    qtbot.waitUntil(lambda: not window.backend.busy and not window.chat.replying, timeout=5000)


def finished_events(window) -> list[Finished]:
    seen: list[Finished] = []
    window.events_received.connect(
        lambda batch: seen.extend(e for e in batch if isinstance(e, Finished))
    )
    return seen


def test_a_typed_message_streams_its_reply_in(qtbot, backend, make_window):
    backend.gate = threading.Semaphore(0)
    window = make_window(backend)
    tokens: list[Token] = []
    window.events_received.connect(
        lambda batch: tokens.extend(e for e in batch if isinstance(e, Token))
    )
    prefills: list[PrefillDone] = []
    window.events_received.connect(
        lambda batch: prefills.extend(e for e in batch if isinstance(e, PrefillDone))
    )
    finished = finished_events(window)

    type_message(qtbot, window, "Hi there")
    assert window.input.toPlainText() == ""
    assert window.chat.messages() == [Message("user", "Hi there")]
    assert window.chat.replying
    assert not window.send_action.isEnabled() and window.stop_action.isEnabled()

    backend.gate.release(1)
    qtbot.waitUntil(lambda: window.chat.reply_text() == REPLY[0], timeout=5000)
    backend.gate.release(5)
    partial = "".join(REPLY[:6])
    qtbot.waitUntil(lambda: window.chat.reply_text() == partial, timeout=5000)
    assert "**fake**" in window.chat.toPlainText()  # plain text while streaming
    # the context used: the prompt and the reply so far
    prompt = prefills[0].prompt_tokens
    assert window.context_label.text() == f"context {prompt + 6:,} / 2,048"
    backend.gate.release(len(REPLY))
    wait_idle(qtbot, window)
    assert window.context_label.text() == f"context {prompt + len(REPLY):,} / 2,048"

    reply = "".join(t.text for t in tokens)
    assert reply == "".join(REPLY)
    assert finished[0].text == reply and finished[0].reason == "eos"
    assert window.conversation() == [Message("user", "Hi there"), Message("assistant", reply)]
    assert window.chat.messages() == window.conversation()
    assert backend.session.calls == [(Message("user", "Hi there"),)]
    # Markdown was rendered once the reply completed.
    assert "**" not in window.chat.toPlainText() and "fake" in window.chat.toPlainText()
    assert window.speed_label.text() == "TTFT 0.02 s · 100.0 tok/s"  # 1 ms + 2 steps of 10
    assert window.model_label.text() == "fake-135M · cpu · exact float32 · 135M params"
    assert window.send_action.isEnabled() and not window.stop_action.isEnabled()


def test_escape_stops_the_reply_with_reason_cancelled(qtbot, backend, make_window):
    backend.gate = threading.Semaphore(0)
    window = make_window(backend)
    finished = finished_events(window)
    type_message(qtbot, window, "Tell me a story")
    backend.gate.release(2)
    qtbot.waitUntil(lambda: window.chat.reply_text() == "".join(REPLY[:2]), timeout=5000)

    shortcut(qtbot, window, Qt.Key.Key_Escape)
    wait_idle(qtbot, window)
    assert [f.reason for f in finished] == ["cancelled"]
    assert window.conversation()[-1] == Message("assistant", "".join(REPLY[:2]))
    assert "stopped" in window.chat.toPlainText()
    assert window.send_action.isEnabled()


def test_regenerate_replaces_the_last_reply(qtbot, backend, window):
    type_message(qtbot, window, "Question")
    wait_idle(qtbot, window)
    backend.session.pieces = ("Another", " answer")

    shortcut(qtbot, window, Qt.Key.Key_R, Qt.KeyboardModifier.ControlModifier)
    wait_idle(qtbot, window)
    expected = [Message("user", "Question"), Message("assistant", "Another answer")]
    assert window.conversation() == expected
    assert window.chat.messages() == expected
    assert backend.session.calls[1] == backend.session.calls[0] == (Message("user", "Question"),)
    assert "".join(REPLY) not in window.chat.toPlainText()


def test_new_chat_empties_the_chat_and_resets_the_session(qtbot, backend, window):
    changes: list[None] = []
    window.conversation_changed.connect(lambda: changes.append(None))
    type_message(qtbot, window, "Hello")
    wait_idle(qtbot, window)

    shortcut(qtbot, window, Qt.Key.Key_N, Qt.KeyboardModifier.ControlModifier)
    assert window.conversation() == [] and window.chat.messages() == []
    assert window.chat.toPlainText().strip() == ""
    qtbot.waitUntil(lambda: backend.session.resets == 1, timeout=5000)
    assert len(changes) == 3  # message sent, reply finished, chat emptied


def test_new_chat_mid_reply_drops_the_rest_of_it(qtbot, backend, make_window):
    backend.gate = threading.Semaphore(0)
    window = make_window(backend)
    type_message(qtbot, window, "First")
    backend.gate.release(1)
    qtbot.waitUntil(lambda: window.chat.reply_text() != "", timeout=5000)

    window.new_chat()
    qtbot.waitUntil(lambda: not window.backend.busy, timeout=5000)
    assert window.chat.messages() == [] and window.chat.toPlainText().strip() == ""
    backend.gate.release(len(REPLY))
    type_message(qtbot, window, "Second")
    wait_idle(qtbot, window)
    expected = [Message("user", "Second"), Message("assistant", "".join(REPLY))]
    assert window.conversation() == expected


def test_shift_enter_adds_a_line_and_enter_sends_both(qtbot, backend, window):
    qtbot.keyClicks(window.input, "line one")
    qtbot.keyClick(window.input, Qt.Key.Key_Return, Qt.KeyboardModifier.ShiftModifier)
    qtbot.keyClicks(window.input, "line two")
    assert window.input.toPlainText() == "line one\nline two"
    assert backend.session.calls == []

    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    wait_idle(qtbot, window)
    assert backend.session.calls[0] == (Message("user", "line one\nline two"),)


def test_an_empty_message_is_refused_with_a_reason(qtbot, backend, window):
    type_message(qtbot, window, "   ")
    assert "Nothing to send" in window.statusBar().currentMessage()
    assert backend.session.calls == [] and window.chat.messages() == []
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    assert backend.session.calls == []


def test_typing_while_a_reply_streams_is_kept_and_not_sent(qtbot, backend, make_window):
    backend.gate = threading.Semaphore(0)
    window = make_window(backend)
    type_message(qtbot, window, "One")
    type_message(qtbot, window, "Two")
    assert window.input.toPlainText() == "Two"
    assert "still streaming" in window.statusBar().currentMessage()
    backend.gate.release(len(REPLY))
    wait_idle(qtbot, window)
    assert len(backend.session.calls) == 1


def test_the_system_prompt_goes_first(qtbot, backend, window):
    window.settings_panel.set_system_prompt("Answer in French.")
    type_message(qtbot, window, "Hello")
    wait_idle(qtbot, window)
    assert backend.session.calls[0] == (
        Message("system", "Answer in French."),
        Message("user", "Hello"),
    )
    assert window.conversation()[0] == Message("user", "Hello")

    window.settings_panel.set_system_prompt("  ")
    type_message(qtbot, window, "Again")
    wait_idle(qtbot, window)
    assert backend.session.calls[1][0] == Message("user", "Hello")


def test_a_failing_generation_shows_its_message_and_the_chat_goes_on(qtbot, backend, window):
    backend.session.raise_after = 2
    type_message(qtbot, window, "Break")
    wait_idle(qtbot, window)
    assert BROKEN in window.chat.toPlainText()
    assert BROKEN in window.statusBar().currentMessage()
    assert window.conversation()[-1] == Message("assistant", "".join(REPLY[:2]))

    backend.session.raise_after = None
    type_message(qtbot, window, "Again")
    wait_idle(qtbot, window)
    assert window.conversation()[-1] == Message("assistant", "".join(REPLY))


def test_a_failed_load_keeps_the_previous_model_and_says_why(qtbot, backend, window):
    picker = window.open_model_picker()
    picker.set_location("hub", "broken")
    with qtbot.waitSignal(window.backend.load_failed, timeout=5000):
        qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: not window.backend.busy, timeout=5000)

    assert "No model at broken" in picker.status_text()
    assert picker.isVisible() and picker.load_button.isEnabled()
    assert window.model_label.text().startswith("fake-135M ·")
    assert "Still using fake-135M" in window.statusBar().currentMessage()
    picker.reject()

    type_message(qtbot, window, "Still there?")
    wait_idle(qtbot, window)
    assert window.conversation()[-1] == Message("assistant", "".join(REPLY))


def test_a_model_too_big_is_offered_the_placement_that_fits(qtbot, backend, window):
    # Loaded from outside the picker (as from the command line): the picker opens to offer it.
    window.load_model(LoadRequest(spec="too-big"))
    qtbot.waitUntil(lambda: window.picker is not None and window.picker.fit_button.isVisible())
    picker = window.picker
    assert "5.0 GB missing" in picker.status_text()
    assert picker.fit_button.text() == (
        "Load with automatic placement, a RAM cap of 2048 MiB (the rest on disk)"
    )
    assert "Could not load the model: too-big needs" in window.chat.toPlainText()
    assert window.model_label.text().startswith("fake-135M ·")

    with qtbot.waitSignal(window.backend.loaded, timeout=5000):
        qtbot.mouseClick(picker.fit_button, Qt.MouseButton.LeftButton)
    assert backend.requests[-1].device_map == "auto"
    assert backend.requests[-1].max_memory == "cpu=2048MiB"
    assert window.model_label.text().startswith("too-big ·")
    qtbot.waitUntil(lambda: window.picker is None or not window.picker.isVisible())


def test_a_failed_load_offers_no_placement_when_none_would_help(qtbot, backend, window):
    picker = window.open_model_picker()
    picker.set_location("hub", "broken")
    with qtbot.waitSignal(window.backend.load_failed, timeout=5000):
        qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    assert not picker.fit_button.isVisible()
    picker.reject()


def test_the_picker_loads_a_hub_model_on_the_chosen_device(qtbot, backend, window):
    picker = window.open_model_picker()
    picker.set_location("hub", "org/other-model")
    picker.set_device("cpu")
    picker.set_dtype("bfloat16")
    progress: list[float] = []
    window.backend.load_progress.connect(lambda stage, f: progress.append(f))
    with qtbot.waitSignal(window.model_changed, timeout=5000):
        qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)

    assert backend.requests[-1] == LoadRequest("org/other-model", "cpu", "bfloat16")
    assert progress[-1] == 1.0
    qtbot.waitUntil(lambda: not picker.isVisible(), timeout=2000)
    assert window.model_label.text() == "org/other-model · cpu · exact bfloat16 · 135M params"
    assert window.info.name == "org/other-model"


def test_the_picker_asks_for_the_chosen_precision(qtbot):
    picker = ModelPicker(LoadRequest(precision="exact"))
    qtbot.addWidget(picker)
    assert picker.request().precision == "exact"  # shown as it was asked for
    picker.set_precision("fast")
    assert picker.request() == LoadRequest("bundled", "auto", "auto", precision="fast")


def test_the_picker_refuses_a_missing_folder_or_gguf(qtbot, tmp_path):
    picker = ModelPicker(LoadRequest())
    qtbot.addWidget(picker)
    requests: list[LoadRequest] = []
    picker.load_requested.connect(requests.append)
    picker.set_location("folder", str(tmp_path / "nowhere"))
    qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    assert "is not a folder" in picker.status_text()
    picker.set_location("gguf", str(tmp_path / "model.bin"))
    qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    assert "is not a .gguf file" in picker.status_text()
    picker.set_location("hub", "")
    qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    assert "Type a hub id" in picker.status_text()
    assert requests == []

    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    picker.set_location("gguf", str(tmp_path / "model.gguf"))
    picker.set_dtype("float16")
    qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    assert requests == [LoadRequest(str(tmp_path / "model.gguf"), "auto", "float16")]
    assert picker.is_loading()


def test_a_failed_load_gives_the_focus_back_to_the_location(qtbot, tmp_path):
    """Its text selected, so a corrected path typed at once replaces it, in the same source."""
    picker = ModelPicker(LoadRequest())
    qtbot.addWidget(picker)
    picker.show()
    qtbot.waitExposed(picker)
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    picker.set_location("gguf", str(tmp_path / "model.gguf"))
    qtbot.mouseClick(picker.load_button, Qt.MouseButton.LeftButton)
    assert picker.is_loading()
    picker.set_failed("model.gguf is not a readable GGUF model")
    editor = picker.focusWidget()
    assert editor is picker._gguf and editor.selectedText() == str(tmp_path / "model.gguf")
    qtbot.keyClicks(editor, str(tmp_path / "other.gguf"))
    assert picker.request().spec == str(tmp_path / "other.gguf")


def test_closing_mid_reply_is_quick_and_leaves_no_thread(qtbot, backend, make_window):
    backend.gate = threading.Semaphore(0)  # the reply would never end by itself
    window = make_window(backend)
    type_message(qtbot, window, "Long answer please")
    qtbot.waitUntil(backend.session.started.is_set, timeout=5000)

    started = time.perf_counter()
    window.close()
    assert time.perf_counter() - started < 2
    assert not window.backend.is_running()


def test_docks_are_added_and_their_place_remembered(qtbot, backend, make_window, qsettings):
    window = make_window(backend)
    dock = QDockWidget("Attention")
    dock.setWidget(QLabel("heads"))
    window.add_dock(dock)
    assert dock.objectName() == "attention_dock"
    assert window.dockWidgetArea(dock) == Qt.DockWidgetArea.RightDockWidgetArea
    assert dock.toggleViewAction() in window.view_menu.actions()
    window.addDockWidget(Qt.DockWidgetArea.BottomDockWidgetArea, dock)  # the user moves it
    qtbot.waitUntil(dock.isVisible, timeout=2000)
    window.close()

    again = make_window(backend)
    dock = QDockWidget("Attention")
    again.add_dock(dock)
    assert again.dockWidgetArea(dock) == Qt.DockWidgetArea.BottomDockWidgetArea
    assert not dock.isHidden()
    dock.toggleViewAction().trigger()  # the user closes the panel
    again.close()

    third = make_window(backend)
    dock = QDockWidget("Attention")
    third.add_dock(dock)
    assert dock.isHidden() and not dock.toggleViewAction().isChecked()


def test_settings_panel_builds_valid_settings():
    panel = SettingsPanel()
    assert panel.settings() == GenerationSettings()
    custom = GenerationSettings(
        max_new_tokens=64, temperature=1.3, top_k=0, top_p=0.5, repetition_penalty=1.2, seed=7
    )
    panel.set_settings(custom)
    assert panel.settings() == custom
    panel.set_settings(GenerationSettings(greedy=True, use_cache=False))
    assert panel.settings().greedy and not panel.settings().use_cache
    assert not panel._temperature.isEnabled() and not panel._top_p.isEnabled()
    panel.set_system_prompt("  Be terse.\n")
    assert panel.system_prompt() == "Be terse."


def token(index: int, text: str) -> Token:
    return Token(index, 100 + index, text, text, 0.01, 0, ())


def finished(text: str, tokens: int) -> Finished:
    return Tally(started=time.perf_counter(), generated=tokens).finished("eos", text)


def test_chat_view_renders_markdown_and_keeps_plain_text(qtbot):
    conversation = Conversation()
    view = ChatView(conversation)
    qtbot.addWidget(view)
    source = (
        "Some *text*.\n\n```python\nif a < b:\n    print('<x>')\n```\n\n"
        "| a | b |\n|---|---|\n| 1 | 2 |"
    )
    conversation.load([Entry("user", "<b>not bold</b>"), Entry("assistant", source)])
    assert view.messages() == [Message("user", "<b>not bold</b>"), Message("assistant", source)]
    text = view.toPlainText()
    assert "<b>not bold</b>" in text and "*text*" not in text and "```" not in text

    code = view.document().find("print('<x>')")
    assert not code.isNull()
    family = code.charFormat().fontFamilies() or [code.charFormat().fontFamily()]
    assert code.charFormat().fontFixedPitch() or any("mono" in f.lower() for f in family)
    tables = {type(f).__name__ for f in _frames(view)}
    assert "QTextTable" in tables  # the Markdown table, and the code block's box

    conversation.drop_last_reply()
    assert view.messages() == [Message("user", "<b>not bold</b>")]
    assert "print" not in view.toPlainText()
    conversation.clear()
    assert view.messages() == [] and view.toPlainText() == ""


def test_chat_view_streams_into_one_reply(qtbot):
    conversation = Conversation()
    view = ChatView(conversation)
    qtbot.addWidget(view)
    conversation.add_user("Hi", GenerationSettings(), "tiny")
    conversation.start_reply(GenerationSettings(), "tiny")
    before = view.document().findBlockByNumber(0).text()
    for index, chunk in enumerate(("Hel", "lo **wor", "ld**")):
        conversation.apply(token(index, chunk))
    assert view.reply_text() == "Hello **world**"
    assert view.messages() == [Message("user", "Hi")]  # the reply is not complete yet
    assert view.document().findBlockByNumber(0).text() == before
    conversation.apply(finished("Hello **world**", 3))
    assert view.messages()[-1] == Message("assistant", "Hello **world**")
    cursor = view.document().find("world")
    assert cursor.charFormat().fontWeight() > 400  # rendered bold
    assert "3 tokens" in view.toPlainText() and not view.replying
    assert view.document().find("Hi", 0).position() < cursor.position()


def test_a_reloaded_reply_shows_its_stats_and_whether_it_was_cut_off(qtbot):
    stats = {"generated_tokens": 2, "ttft_s": 0.5, "decode_tokens_per_s": 4.0}
    conversation = Conversation()
    view = ChatView(conversation)
    qtbot.addWidget(view)
    conversation.load([Entry("user", "Hi"), Entry("assistant", "Hello", stats=stats)])
    assert "2 tokens · TTFT 0.50 s · 4.0 tok/s" in view.toPlainText()
    assert "incomplete" not in view.toPlainText()
    conversation.load([Entry("user", "Hi"), Entry("assistant", "Hel", complete=False)])
    assert "incomplete: cut off" in view.toPlainText()


@pytest.mark.parametrize(
    "text", ["Colours:\n\n1. Green\n2. Red", "- one\n- two", "```\nprint(1)\n```"]
)
def test_the_stats_line_stands_apart_from_a_reply_that_ends_in_a_list_or_code(qtbot, text):
    """It was drawn as the list's next item ("4. 34-token prompt ...") in the real window."""
    stats = {"generated_tokens": 2, "ttft_s": 0.5, "decode_tokens_per_s": 4.0}
    conversation = Conversation()
    view = ChatView(conversation)
    qtbot.addWidget(view)
    conversation.load([Entry("user", "Hi"), Entry("assistant", text, stats=stats)])
    block = view.document().find("2 tokens · TTFT").block()
    assert block.isValid() and block.text().startswith("2 tokens")
    assert block.textList() is None
    assert block.blockFormat().nonBreakableLines() is False  # not inside the code block
    assert block.blockFormat().indent() == 0 and block.blockFormat().leftMargin() == 0


def _frames(view: ChatView):
    stack, found = [view.document().rootFrame()], []
    while stack:
        frame = stack.pop()
        found.append(frame)
        stack.extend(frame.childFrames())
    return found


@pytest.mark.parametrize(
    ("n", "text"),
    [(950, "950"), (12_345, "12K"), (134_515_008, "135M"), (1_235_814_400, "1.2B"), (10**9, "1B")],
)
def test_human_count(n, text):
    assert human_count(n) == text


def test_the_status_bar_says_when_the_decode_step_is_compiled(window):
    worker = window.backend
    worker.decode_step.emit("compiled")
    assert window.statusBar().currentMessage().startswith("Decode step compiled")
    worker.decode_step.emit("eager: RuntimeError: no C compiler")
    message = window.statusBar().currentMessage()
    assert "uncompiled" in message and "no C compiler" in message and "eager:" not in message


class LayoutRequests(QObject):
    """Counts the layout requests the object it filters receives."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:
        if event.type() == QEvent.Type.LayoutRequest:
            self.count += 1
        return False


def settle() -> None:
    for _ in range(3):  # a label's request reaches the status bar, whose layout asks the window
        QCoreApplication.processEvents()


@pytest.mark.parametrize("label", ["context_label", "speed_label"])
def test_a_status_line_that_changes_per_delivery_does_not_lay_out_the_window(window, label):
    """The status bar's context and speed lines change while a reply streams: each new text
    repaints the label alone, where a plain label's made the main window (every dock) lay out
    again. A text wider than any before makes room once."""
    shown = getattr(window, label)
    requests = LayoutRequests()
    window.installEventFilter(requests)
    shown.setText("context 88,888 / 2,048")
    settle()
    assert requests.count >= 1  # a wider text makes room, once
    assert shown.width() >= shown.sizeHint().width()
    requests.count = 0
    for tokens in range(1_101, 1_165):
        shown.setText(f"context {tokens:,} / 2,048")
        settle()
        assert shown.width() >= shown.sizeHint().width()  # the text is not cut
    assert requests.count == 0
    assert shown.text() == "context 1,164 / 2,048"
    shown.setText("")
    settle()
    assert shown.width() == 0  # an empty line gives its room back
