"""Two hundred turns in the assembled window, a real tiny model behind it: nothing accumulates.

Each turn is short (8 greedy tokens, EOS ignored) but runs the whole path: worker thread,
engine, panels, chat, store. The tiny model's context is 256 tokens, so from about the tenth
turn on the drop-oldest policy leaves early messages out of every request. Between turn 10
(everything warmed up) and turn 200, resident memory, threads and timers must not grow.

About 75 s here (2 cores shared with other work). Fitting the long conversation into the
context costs a handful of encodings per turn: engine/generate/context.py binary-searches how many
of the oldest turns to drop.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import shiboken6
from PySide6.QtCore import QSettings, QThread, QTimer
from PySide6.QtWidgets import QApplication

from app.window import assembly
from engine.events import Finished, PrefillDone, Token
from engine.settings import GenerationSettings, LoadRequest
from tests.engines import in_memory
from tests.models import make_tiny

TURNS = 200
WARM_TURN = 10
CONTEXT = 256  # tokens: a few turns fill it
REPLY = GenerationSettings(greedy=True, max_new_tokens=8, ignore_eos=True)
MAX_RSS_GROWTH = 50 * 2**20


@pytest.fixture
def one_torch_thread():
    """Two cores shared with other jobs: two OpenMP threads would spin against each other
    (3.5x slower here when another test run is busy)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def tracked_qthreads(monkeypatch):
    """Every QThread started during the test (Qt keeps no registry of its own)."""
    started: list[QThread] = []
    original = QThread.start

    def start(self, *args, **kwargs):
        started.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(QThread, "start", start)
    return started


def running(threads: list[QThread]) -> int:
    return sum(1 for t in threads if shiboken6.isValid(t) and t.isRunning())


def timer_count(parts: assembly.Parts) -> int:
    """QTimers under the window, every other top-level widget, the worker and the app."""
    roots = {id(w): w for w in QApplication.topLevelWidgets()}
    roots[id(parts.window)] = parts.window
    owners = [*roots.values(), parts.worker, QApplication.instance()]
    return sum(len(owner.findChildren(QTimer)) for owner in owners)


def snapshot(parts: assembly.Parts, qthreads: list[QThread]) -> dict[str, int]:
    process = psutil.Process()
    return {
        "rss": process.memory_info().rss,
        "python_threads": threading.active_count(),
        "os_threads": process.num_threads(),
        "qthreads": running(qthreads),
        "timers": timer_count(parts),
    }


def test_two_hundred_turns_leak_no_memory_threads_or_timers(
    qtbot, tmp_path, tokenizer, tracked_qthreads, one_torch_thread, monkeypatch
):
    def load(request, progress):
        progress("Ready", 1.0)
        return make_tiny(tokenizer, "llama", max_position_embeddings=CONTEXT)

    worker = in_memory(load)
    settings = QSettings(str(tmp_path / "layout.ini"), QSettings.Format.IniFormat)
    parts = assembly.assemble(worker, database=tmp_path / "chats.sqlite3", settings=settings)
    qtbot.addWidget(parts.window)
    parts.window.show()
    # The settings panel has no switch for ignore_eos: every reply runs its 8 tokens.
    monkeypatch.setattr(parts.window.settings_panel, "settings", lambda: REPLY)
    finished: list[Finished] = []
    dropped: list[int] = []
    pieces: list[str] = []

    def on_events(batch):
        for event in batch:
            if isinstance(event, Finished):
                finished.append(event)
            elif isinstance(event, PrefillDone):
                dropped.append(event.dropped_messages)
                pieces.clear()
            elif isinstance(event, Token):
                pieces.append(event.piece)

    parts.window.events_received.connect(on_events)
    try:
        with qtbot.waitSignal(worker.loaded, timeout=30000):
            parts.window.load_model(LoadRequest(spec="tiny"))
        qtbot.waitUntil(lambda: not worker.busy, timeout=10000)
        started = time.perf_counter()
        for turn in range(1, TURNS + 1):
            assert parts.window.send(f"Question {turn}: what comes after {turn}?")
            qtbot.waitUntil(lambda turn=turn: len(finished) == turn and not worker.busy)
            parts.internals.redraw(force=True)  # docks tabbed out of sight draw too
            if turn == WARM_TURN:
                warm = snapshot(parts, tracked_qthreads)
        end = snapshot(parts, tracked_qthreads)
        elapsed = time.perf_counter() - started
        strip = parts.internals.next_token.tokens.toPlainText().replace("\u200b", "")
    finally:
        parts.window.close()
        parts.shutdown()

    print(f"\n{TURNS} turns in {elapsed:.1f} s; turn {WARM_TURN}: {warm}; turn {TURNS}: {end}")
    assert [f.reason for f in finished] == ["length"] * TURNS
    assert all(f.generated_tokens == 8 for f in finished)
    assert dropped[-1] > TURNS  # most of the conversation no longer fits
    assert len(parts.window.conversation()) == 2 * TURNS  # the window still shows every turn
    # The strip shows the last reply, not an older one (its HTML drops a leading space).
    assert strip.split() == "".join(pieces).split()
    assert end["rss"] - warm["rss"] < MAX_RSS_GROWTH
    for key in ("python_threads", "qthreads", "timers"):
        assert end[key] == warm[key], key
    # The process's own threads also count pools that end idle threads (Qt's global pool
    # after 30 s): fewer at the end is no leak, more would be.
    assert end["os_threads"] <= warm["os_threads"], "os_threads"
