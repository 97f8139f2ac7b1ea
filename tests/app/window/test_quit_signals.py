"""SIGTERM or Ctrl+C mid-reply closes the window as its close button does: the process exits
cleanly, the partial reply is kept and marked incomplete, and the engine and its shared-memory
folder are gone. Run in a fresh interpreter (the fake engine in the child), as `glassbox` runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from app.storage.store import ConversationStore

ROOT = Path(__file__).resolve().parents[3]

SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})

def main():
    from app.server.engine_process import EngineProcess
    from app.server.engine_spec import EngineSpec
    engine = EngineProcess(EngineSpec(loader="tests.ui.fakes:process_loader",
                                      session_factory="tests.ui.fakes:process_session",
                                      preload=()))
    from PySide6.QtCore import QSettings, QTimer
    from PySide6.QtWidgets import QApplication
    from app.window.gui import open_window
    from app.window.quit_signals import CloseOnSignals
    from engine.events import Token
    from engine.settings import GenerationSettings, LoadRequest
    layout = QSettings({layout!r}, QSettings.Format.IniFormat)
    parts = open_window(engine, database={database!r}, settings=layout)
    app = QApplication.instance()
    app.aboutToQuit.connect(parts.shutdown)
    CloseOnSignals(parts.window)
    window = parts.window
    window.load_model(LoadRequest(spec="fake", extra={{"tokens": "1000", "delay": "0.02"}}))
    window.settings_panel.set_settings(GenerationSettings(greedy=True, max_new_tokens=1000))
    tokens = []
    window.events_received.connect(
        lambda batch: tokens.extend(e for e in batch if isinstance(e, Token))
    )
    window.send("Tell me a long story")

    def streaming():
        if len(tokens) >= 5:
            print("streaming", flush=True)
            timer.stop()

    timer = QTimer()
    timer.timeout.connect(streaming)
    timer.start(20)
    code = app.exec()
    window.close()
    parts.shutdown()
    print(json.dumps({{
        "code": code,
        "shared": str(engine.shared.path) if engine.shared else None,
        "engine_alive": engine.process.is_alive(),
    }}))

if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("number", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_reply_closes_the_window_and_keeps_the_partial_reply(tmp_path, number):
    database = tmp_path / "chats.sqlite3"
    script = tmp_path / "window.py"
    script.write_text(
        textwrap.dedent(SCRIPT).format(
            root=str(ROOT), layout=str(tmp_path / "layout.ini"), database=str(database)
        )
    )
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    child = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "streaming", child.stderr.read()[-2000:]
        os.kill(child.pid, number)
        started = time.perf_counter()
        out, err = child.communicate(timeout=30)
        took = time.perf_counter() - started
    finally:
        child.kill()
        child.wait()
    assert child.returncode == 0, err[-2000:]
    assert "Traceback" not in err and took < 10
    result = json.loads(out.strip().splitlines()[-1])
    assert result["code"] == 0 and not result["engine_alive"]
    assert result["shared"] is not None and not Path(result["shared"]).exists()

    with ConversationStore(database) as store:
        (conversation,) = store.list_conversations()
        question, partial = store.messages(conversation.id)
    assert question.text == "Tell me a long story"
    assert partial.text.startswith(" w0 w1 w2 w3 w4") and not partial.complete
