"""The chat window on the real engine: a tiny random Llama and a byte-level tokenizer, built in
memory (no download), answered through the engine server and ChatSession."""

from __future__ import annotations

import pytest
from PySide6.QtCore import Qt

from engine.events import Finished, PrefillDone, Token
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel
from engine.settings import GenerationSettings, LoadRequest, Message
from tests.app import engine_models
from tests.engines import in_memory
from ui.main_window import MainWindow


@pytest.fixture(scope="module")
def tiny_llama() -> LoadedModel:
    return engine_models.tiny_llama(LoadRequest("tiny"), lambda stage, fraction: None)


def test_a_real_session_streams_a_reply_into_the_window(qtbot, qsettings, tiny_llama):
    worker = in_memory(lambda request, progress: tiny_llama, ChatSession)
    window = MainWindow(worker, settings=qsettings)
    qtbot.addWidget(window)
    window.settings_panel.set_settings(GenerationSettings(greedy=True, max_new_tokens=24))
    events: list = []
    window.events_received.connect(events.extend)
    try:
        with qtbot.waitSignal(worker.loaded, timeout=10_000):
            window.load_model(LoadRequest("tiny"))
        qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
        assert window.model_label.text().startswith("tiny-llama · cpu · exact float32 · ")

        qtbot.keyClicks(window.input, "Hello, tiny model")
        qtbot.keyClick(window.input, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: not worker.busy and not window.chat.replying, timeout=30_000)
    finally:
        worker.shutdown()

    assert isinstance(events[0], PrefillDone) and isinstance(events[-1], Finished)
    finished = events[-1]
    tokens = [e for e in events if isinstance(e, Token)]
    assert finished.reason in ("eos", "length")
    assert len(tokens) == finished.generated_tokens >= 1
    assert "".join(t.text for t in tokens) == finished.text
    assert finished.prompt_tokens == events[0].prompt_tokens > len("Hello, tiny model")
    assert window.conversation() == [
        Message("user", "Hello, tiny model"),
        Message("assistant", finished.text),
    ]
    assert window.speed_label.text().startswith(f"TTFT {finished.ttft_s:.2f} s")
