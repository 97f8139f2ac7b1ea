"""The engine in its own process: events cross unchanged and in order, Stop reaches it within a
step, a killed engine is survived and replaced, and nothing is left running after shutdown.

Most tests run the fake session of tests/ui/fakes.py in the child (it starts in a fraction of
a second); one runs a tiny real Llama there, in a fresh interpreter that checks the window's
process never imports torch.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PySide6.QtCore import QCoreApplication, QSettings, Qt
from PySide6.QtWidgets import QDockWidget, QMainWindow

from app.client.engine_client import RESTART_NOTE, EngineClient
from app.server import pipe
from app.server.engine_process import ENGINE_NICENESS, EngineProcess
from app.server.engine_spec import EngineSpec
from app.server.pipe import receive_message, send_message
from app.server.shared_arrays import MIN_SHARED_BYTES, take
from app.server.wire import Events
from app.window import assembly
from engine.events import ENGINE_STOPPED, Failed, Finished, PrefillDone, Token, frozen_array
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings
from tests.waiting import wait_until

FAKE = EngineSpec(
    loader="tests.ui.fakes:process_loader",
    session_factory="tests.ui.fakes:process_session",
    preload=(),
)
HELLO = (Message("user", "hello"),)
SETTINGS = GenerationSettings(greedy=True, max_new_tokens=1000)
ROOT = Path(__file__).resolve().parents[3]


def fake_request(tokens: int = 0, delay: float = 0.0, spec: str = "fake") -> LoadRequest:
    return LoadRequest(spec=spec, extra={"tokens": str(tokens), "delay": str(delay)})


@pytest.fixture
def worker(qtbot):
    worker = EngineClient(EngineProcess(FAKE))
    yield worker
    worker.shutdown()


def load(qtbot, worker, request: LoadRequest) -> None:
    with qtbot.waitSignal(worker.loaded, timeout=10_000):
        worker.load(request)
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)


def collect(worker) -> list:
    events: list = []
    worker.events.connect(events.extend)
    return events


def test_events_cross_in_order_on_the_gui_thread_and_the_worker_goes_idle(qtbot, worker):
    progress: list = []
    worker.load_progress.connect(lambda stage, fraction: progress.append((stage, fraction)))
    load(qtbot, worker, fake_request(tokens=300))
    assert worker.info.name == "fake" and ("Ready", 1.0) in progress
    events, threads = collect(worker), set()
    worker.events.connect(lambda _batch: threads.add(QCoreApplication.instance().thread()))
    with qtbot.waitSignal(worker.busy_changed, timeout=10_000, check_params_cb=lambda b: not b):
        assert worker.generate(HELLO, SETTINGS)

    assert isinstance(events[0], PrefillDone) and isinstance(events[-1], Finished)
    tokens = [e for e in events if isinstance(e, Token)]
    assert [t.index for t in tokens] == list(range(300))
    assert events[-1].text == "".join(f" w{i}" for i in range(300))
    assert worker.transport.events == len(events)
    assert worker.transport.messages < len(events)  # the child coalesces what waits
    assert len(threads) == 1


def test_stop_reaches_the_engine_within_one_step(qtbot, worker):
    load(qtbot, worker, fake_request(tokens=1000, delay=0.1))
    events = collect(worker)
    assert worker.generate(HELLO, SETTINGS)
    qtbot.waitUntil(lambda: sum(isinstance(e, Token) for e in events) >= 2, timeout=10_000)
    seen = sum(isinstance(e, Token) for e in events)
    started = time.perf_counter()
    worker.stop()
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    (end,) = [e for e in events if isinstance(e, Finished)]
    assert end.reason == "cancelled"
    assert end.generated_tokens <= seen + 2  # the step running, and one in flight at most
    assert time.perf_counter() - started < 1.0  # 0.1 s steps: not queued behind the reply


def reported(qtbot, spec: EngineSpec, replies: int = 1) -> list[str]:
    """The Finished texts of `replies` replies of thread_counting_session in `spec`'s child."""
    worker = EngineClient(EngineProcess(spec))
    texts = []
    try:
        load(qtbot, worker, fake_request(tokens=5))
        for _reply in range(replies):
            events = collect(worker)
            assert worker.generate(HELLO, SETTINGS)
            qtbot.waitUntil(lambda: not worker.busy, timeout=10_000)
            texts.append(events[-1].text)
    finally:
        worker.shutdown()
    return texts


COUNTING = EngineSpec(
    FAKE.loader, "tests.app.engine_models:thread_counting_session", preload=("torch",)
)


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no process priorities here")
def test_the_engine_gives_way_to_the_window_and_processes_prompts_on_every_core(qtbot, monkeypatch):
    """Prefill threads while the prompt is processed, decode threads from PrefillDone on (and
    back for the next prompt); one step lower in priority than the window, OpenMP's waiting
    left as it is. The terminal's engine keeps its priority."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    niceness = os.nice(0)
    beside = replace(COUNTING, threads=1, prefill_threads=2)
    lower = min(niceness + ENGINE_NICENESS, 19)
    assert reported(qtbot, beside, replies=2) == [f"2,1,{lower},None"] * 2
    terminal = replace(COUNTING, threads=2, prefill_threads=2, beside_window=False)
    assert reported(qtbot, terminal) == [f"2,2,{niceness},None"]


def test_thread_counts_leave_the_window_a_core_only_while_decoding_on_larger_machines(
    monkeypatch,
):
    from app.server.engine_server import Threads

    monkeypatch.delenv("GLASSBOX_ENGINE_THREADS", raising=False)
    monkeypatch.delenv("GLASSBOX_PREFILL_THREADS", raising=False)
    assert Threads.of(EngineSpec(), cores=2, logical=2) == Threads(prefill=2, decode=2)
    assert Threads.of(EngineSpec(), cores=1, logical=1) == Threads(prefill=1, decode=1)
    assert Threads.of(EngineSpec(), cores=4, logical=4) == Threads(prefill=4, decode=3)
    # Two hardware threads a core: the window takes a second thread, not a core.
    assert Threads.of(EngineSpec(), cores=8, logical=16) == Threads(prefill=8, decode=8)
    assert Threads.of(EngineSpec(threads=3, prefill_threads=5), 8, 8) == Threads(5, 3)
    assert Threads.of(EngineSpec(beside_window=False), 4, 4) == Threads(4, 4)  # the terminal's
    monkeypatch.setenv("GLASSBOX_ENGINE_THREADS", "2")
    monkeypatch.setenv("GLASSBOX_PREFILL_THREADS", "6")
    assert Threads.of(EngineSpec(), cores=8, logical=8) == Threads(prefill=6, decode=2)
    monkeypatch.setenv("GLASSBOX_ENGINE_THREADS", "two")  # not a count: the default, logged
    monkeypatch.setenv("GLASSBOX_PREFILL_THREADS", "-1")
    assert Threads.of(EngineSpec(), cores=8, logical=8) == Threads(prefill=8, decode=7)
    # The terminal's engine (the window bench's reference) runs as the terminal chat does.
    assert Threads.of(EngineSpec(beside_window=False), 8, 8) == Threads(prefill=8, decode=8)


def test_a_failed_load_in_the_engine_keeps_the_model_and_counts_tokens(qtbot, worker):
    load(qtbot, worker, fake_request())
    failures: list[str] = []
    worker.load_failed.connect(failures.append)
    with qtbot.waitSignal(worker.load_failed, timeout=5000):
        worker.load(fake_request(spec="broken"))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert failures == ["No model at broken: that file or folder does not exist."]
    assert worker.info.name == "fake"
    with qtbot.waitSignal(worker.tokens_counted, timeout=5000) as counted:
        ident = worker.count_tokens([Message("user", "three words here")])
    assert counted.args == [ident, 6]  # the fake session counts words + 3


def test_a_killed_idle_engine_is_reported_and_replaced_on_the_next_request(qtbot, worker):
    load(qtbot, worker, fake_request())
    with qtbot.waitSignal(worker.load_failed, timeout=5000):
        worker.load(fake_request(spec="broken"))  # the model in use stays "fake"
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    shared = worker.engine.shared
    assert shared is not None and shared.path.is_dir()  # /dev/shm: Linux
    with qtbot.waitSignal(worker.engine_stopped, timeout=5000) as stopped:
        worker.engine.kill()
    assert "killed (SIGKILL" in stopped.args[0] and RESTART_NOTE in stopped.args[0]
    assert worker.engine is None and not worker.is_running()
    assert not shared.path.exists()  # the dead engine's arrays in transit are gone with it

    events = collect(worker)
    announced: list = []
    worker.loaded.connect(announced.append)
    assert worker.generate(HELLO, SETTINGS)  # the same model, reloaded first
    qtbot.waitUntil(lambda: not worker.busy, timeout=10_000)
    assert events[-1].reason == "eos" and worker.restarts == 1
    assert announced == [] and worker.info.name == "fake"  # nothing changed for the window


def test_loading_another_model_after_a_crash_does_not_reload_the_old_one(qtbot, worker):
    load(qtbot, worker, fake_request())
    with qtbot.waitSignal(worker.engine_stopped, timeout=5000):
        worker.engine.kill()
    stages: list[str] = []
    worker.load_progress.connect(lambda stage, _fraction: stages.append(stage))
    with qtbot.waitSignal(worker.loaded, timeout=10_000) as loaded:
        worker.load(fake_request(spec="other"))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert loaded.args[0].name == "other" and worker.restarts == 1
    assert not any(stage.startswith("Starting a new engine") for stage in stages)


def test_shutdown_mid_reply_is_quick_and_leaves_no_process_or_thread(qtbot, worker):
    load(qtbot, worker, fake_request(tokens=1000, delay=0.05))
    events = collect(worker)
    assert worker.generate(HELLO, SETTINGS)
    qtbot.waitUntil(lambda: any(isinstance(e, Token) for e in events), timeout=10_000)
    process, shared = worker.engine.process, worker.engine.shared
    started = time.perf_counter()
    worker.shutdown()
    assert time.perf_counter() - started < 2
    assert not worker.is_running() and process.exitcode == 0  # it quit, it was not killed
    assert shared is not None and not shared.path.exists()
    assert multiprocessing.active_children() == []
    worker.shutdown()  # twice is fine
    assert not worker.generate(HELLO, SETTINGS)


def test_attention_rows_at_ten_thousand_keys_cross_once_per_token_read_only():
    """A token's rows at 10,000 keys, 4 layers x 9 heads: the arrays' bytes and a small header,
    no history; they come back equal and read-only, as events are."""
    rng = np.random.default_rng(0)
    rows = {layer: frozen_array(rng.random((9, 10_000))) for layer in range(4)}
    token = Token(0, 1, "a", "a", 0.01, 0, (), attention=rows)
    reader, writer = multiprocessing.Pipe(duplex=False)
    sent: list[int] = []
    sender = threading.Thread(target=lambda: sent.append(send_message(writer, message)))
    message = Events(1, (token,))
    try:
        sender.start()  # a pipe holds less than a token: the writer waits for the reader
        reply, received = receive_message(reader)
        sender.join(10)
    finally:
        reader.close()
        writer.close()
    assert 4 * 9 * 10_000 * 4 < sent[0] == received < 4 * 9 * 10_000 * 4 + 2048
    (back,) = reply.events
    assert isinstance(reply, Events) and back.text == "a"
    for layer, array in rows.items():
        np.testing.assert_array_equal(back.attention[layer], array)
        assert not back.attention[layer].flags.writeable


def test_a_long_prompts_attention_crosses_through_shared_memory(qtbot, worker, monkeypatch):
    """The engine child writes the prompt's rows (2.6 MB a layer here) to shared memory; the
    window maps them: causal rows that each sum to one, read-only, and nothing left behind."""
    taken: list[str] = []
    monkeypatch.setattr(pipe, "take", lambda path: taken.append(path) or take(path))
    load(qtbot, worker, fake_request(tokens=3))
    events = collect(worker)
    prompt = (Message("user", " ".join(["word"] * 640)),)
    probes = ProbeSettings(attention_layers=(0, 1), prefill_rows=256)
    with qtbot.waitSignal(worker.busy_changed, timeout=10_000, check_params_cb=lambda b: not b):
        assert worker.generate(prompt, SETTINGS, probes)

    prefill = events[0]
    assert isinstance(prefill, PrefillDone) and prefill.prompt_tokens == 643
    assert len(taken) == 2 and os.listdir(worker.engine.shared.path) == []
    keys = np.arange(643)
    for layer in (0, 1):
        rows = prefill.attention[layer]
        assert rows.shape == (4, 256, 643) and rows.nbytes >= MIN_SHARED_BYTES
        np.testing.assert_allclose(rows.sum(axis=2), 1.0, rtol=1e-5)
        future = keys[None, :] > np.arange(643 - 256, 643)[:, None]  # after each row's query
        assert not rows[:, future].any() and not rows.flags.writeable


# -- the window on the engine process ----------------------------------------------------------


@pytest.fixture
def window_parts(qtbot, tmp_path):
    worker = EngineClient(EngineProcess(FAKE))
    settings = QSettings(str(tmp_path / "layout.ini"), QSettings.Format.IniFormat)
    parts = assembly.assemble(worker, database=tmp_path / "chats.sqlite3", settings=settings)
    qtbot.addWidget(parts.window)
    parts.window.show()
    with qtbot.waitSignal(worker.loaded, timeout=10_000):
        parts.window.load_model(fake_request(tokens=1000, delay=0.02))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    yield parts
    parts.window.close()
    parts.shutdown()


def test_sigkill_mid_reply_keeps_the_partial_reply_and_the_next_message_is_answered(
    qtbot, window_parts
):
    parts = window_parts
    window, worker = parts.window, parts.worker
    events: list = []
    window.events_received.connect(events.extend)
    window.settings_panel.set_settings(GenerationSettings(greedy=True, max_new_tokens=1000))
    assert window.send("Tell me a long story")
    qtbot.waitUntil(lambda: sum(isinstance(e, Token) for e in events) >= 5, timeout=10_000)
    worker.engine.kill()
    qtbot.waitUntil(lambda: not window.replying and not worker.busy, timeout=10_000)

    failed = next(e for e in events if isinstance(e, Failed))
    end = events[-1]
    assert failed.error_type == ENGINE_STOPPED and "killed" in failed.message
    assert end.reason == "error" and end.generated_tokens >= 5
    assert end.text == "".join(e.text for e in events if isinstance(e, Token))
    assert failed.message in window.chat.toPlainText()  # said once, in one line
    assert window.chat.toPlainText().count("killed") == 1
    assert window.conversation()[-1] == Message("assistant", end.text)
    store, conversation = parts.controller.store, parts.controller.conversation_id
    _user, partial = store.messages(conversation)
    assert (partial.text, partial.complete) == (end.text, False)  # kept, marked incomplete

    events.clear()
    window.settings_panel.set_settings(GenerationSettings(greedy=True, max_new_tokens=3))
    assert window.send("Are you back?")
    qtbot.waitUntil(lambda: not window.replying and not worker.busy, timeout=10_000)
    assert events[-1].reason == "length" and events[-1].text == " w0 w1 w2"
    assert worker.restarts == 1 and window.info.name == "fake"
    *_, question, answer = store.messages(conversation)
    assert (question.text, answer.text, answer.complete) == ("Are you back?", " w0 w1 w2", True)
    assert len(store.messages(conversation)) == 4


@pytest.mark.parametrize(
    ("error", "state"), [(None, "compiled"), ("RuntimeError: no compiler", "eager: RuntimeError")]
)
def test_the_engine_says_when_the_compiled_decode_step_is_attached(qtbot, error, state):
    spec = EngineSpec(
        loader="tests.app.engine_models:loader_with_error",
        session_factory="tests.app.engine_models:compiled_fast_session",
        preload=(),
    )
    worker = EngineClient(EngineProcess(spec))
    try:
        extra = {"error": error} if error else {}
        with qtbot.waitSignal(worker.decode_step, timeout=10_000) as said:
            worker.load(LoadRequest(spec="fake", extra=extra))
        assert said.args[0].startswith(state) and worker.decode_step_state == said.args[0]
    finally:
        worker.shutdown()


def test_the_window_process_never_imports_torch(tmp_path):
    """The real app path (engine spawned first, then the window) with a tiny real Llama in
    the child: a reply streams into the assembled window, and torch stays out of its process."""
    script = textwrap.dedent(
        f"""
        import json, sys, time
        sys.path.insert(0, {str(ROOT)!r})

        def main():
            from app.server.engine_process import EngineProcess
            from app.server.engine_spec import EngineSpec
            engine = EngineProcess(EngineSpec(loader="tests.app.engine_models:tiny_llama"))
            from PySide6.QtCore import QSettings
            from PySide6.QtWidgets import QApplication
            from app.window.gui import open_window
            from engine.events import Finished
            from engine.settings import GenerationSettings, LoadRequest
            layout = QSettings({str(tmp_path / "layout.ini")!r}, QSettings.Format.IniFormat)
            database = {str(tmp_path / "db.sqlite3")!r}
            parts = open_window(engine, database=database, settings=layout)
            app = QApplication.instance()
            parts.window.load_model(LoadRequest("tiny"))
            parts.window.settings_panel.set_settings(
                GenerationSettings(greedy=True, max_new_tokens=8))
            events = []
            parts.window.events_received.connect(events.extend)
            sent = parts.window.send("Hello")  # typed while the model loads: it waits
            deadline = time.time() + 60
            while not (events and isinstance(events[-1], Finished)) and time.time() < deadline:
                app.processEvents()
                time.sleep(0.005)
            parts.window.close()
            parts.shutdown()
            print(json.dumps({{
                "sent": sent,
                "finished": events[-1].reason if events else None,
                "tokens": events[-1].generated_tokens if events else 0,
                "model": parts.window.info.name if parts.window.info else None,
                "torch": "torch" in sys.modules,
                "transformers": "transformers" in sys.modules,
                "engine_exit": engine.process.exitcode if engine.process else None,
            }}))

        if __name__ == "__main__":
            main()
        """
    )
    path = tmp_path / "window.py"
    path.write_text(script)
    env = {**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"}
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["sent"] and result["finished"] in ("length", "eos") and result["tokens"] >= 1
    assert result["model"] == "tiny-llama"
    assert not result["torch"] and not result["transformers"]


def imported_by(modules: str, watched: tuple[str, ...]) -> list[str]:
    """The modules named in or under `watched` that importing `modules` loads, in a fresh
    interpreter."""
    code = (
        f"import json, sys, {modules}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m in {watched!r}"
        f" or m.split('.')[0] in {watched!r})))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_engine_process_modules_load_no_qt():
    """What the child imports to serve (its contract is in pyproject.toml, run by lint-imports).
    Torch too: it is imported once the child has started."""
    watched = ("PySide6", "shiboken6", "pyqtgraph", "superqt", "ui", "torch")
    assert imported_by("app.server.engine_server, app.server.jobs", watched) == []


def test_the_engine_is_started_before_numpy_or_the_engine_is_imported():
    """The window's process spawns the engine first: the handle it imports for that is light,
    so torch starts importing in the child at once (the engine's modules cost 0.25 s more)."""
    watched = ("numpy", "torch", "engine", "app.server.jobs", "app.server.engine_server")
    assert imported_by("app.server.engine_process", watched) == []
    assert "numpy" in imported_by("app.server.engine_server", watched)  # the check can fail


def test_the_bench_windows_layouts(qapp):
    """The docks as --window-layout asks: floating and shown, left docked in a 1600x1000
    window, or closed; another name is refused."""
    from app.bench.window import arrange_docks

    parts = SimpleNamespace(window=QMainWindow(), internals=SimpleNamespace(docks={}))
    docks = {name: QDockWidget(name, parts.window) for name in ("a", "layers")}
    for dock in docks.values():
        parts.window.addDockWidget(Qt.DockWidgetArea.RightDockWidgetArea, dock)
    parts.window.tabifyDockWidget(docks["a"], docks["layers"])
    docks["a"].raise_()
    parts.internals.docks = docks
    parts.window.show()

    def in_front() -> list[str]:  # a tab behind another has an empty visible region
        qapp.processEvents()
        return [name for name, dock in docks.items() if not dock.visibleRegion().isEmpty()]

    arrange_docks(parts, "docked")
    assert (parts.window.width(), parts.window.height()) == (1600, 1000)
    assert not any(dock.isFloating() for dock in docks.values())
    assert in_front() == ["a"]
    arrange_docks(parts, "docked-layers")
    assert in_front() == ["layers"]
    arrange_docks(parts, "floating")
    assert all(dock.isFloating() and dock.isVisible() for dock in docks.values())
    arrange_docks(parts, "closed")
    assert not any(dock.isVisible() for dock in docks.values())
    with pytest.raises(ValueError, match="one of floating"):
        arrange_docks(parts, "tiled")
    for dock in docks.values():
        dock.close()
    parts.window.close()


def test_bench_window_and_transport_report_their_numbers(qapp):
    """The --window benchmark's whole path, on the fake session instead of the real model."""
    from app.bench.measures import paired
    from app.bench.transport import measure_transport
    from app.bench.window import measure_window

    result = measure_window(fake_request(tokens=40), new_tokens=40, repeats=2, spec=FAKE)
    assert result["model"] == "fake" and result["repeats"] == 2
    runs = result["runs"]
    assert len(runs["window_decode"]) == len(runs["headless_decode"]) == 2
    assert len(runs["terminal_decode"]) == 2 and result["decode_ratio_window_vs_terminal"] > 0
    assert result["decode_tokens_per_s"]["window"] > 0 and result["ttft_s"]["headless"] > 0
    assert result["decode_ratio_window_vs_headless"] > 0
    # The fake's step times are made up, not run, so its wall rates may be 0: the report must
    # still pair them as the decode ratio is paired (test_decode_over_wall_time... for values).
    walls = {way: runs[f"{way}_decode_wall"] for way in ("window", "headless", "terminal")}
    assert all(len(values) == 2 and min(values) >= 0 for values in walls.values())
    assert result["decode_wall_ratio_paired_median"] == paired(walls["window"], walls["headless"])
    assert 0 < result["gui_cpu_per_s"] < 2  # the GUI thread's own CPU, not the process's
    assert 0 <= result["gui_cpu_idle_per_s"] < 2
    assert result["stall_replies"] == 1  # one per two pairs, beside the compared replies
    low, high = result["decode_ratio_paired_ci90"]
    assert low <= result["decode_ratio_paired_median"] <= high
    assert set(result["engine_cpu_s_per_reply"]) == {"window", "headless"}
    assert 0 <= result["stall_ms"]["p50"] <= result["stall_ms"]["p99"] <= result["stall_ms"]["max"]
    assert result["start_s"]["window_shown"] <= result["start_s"]["model_ready"]
    assert result["peak_rss_mb"]["gui"] > 0 and result["peak_rss_mb"]["engine"] > 0
    # Each process's threads by name, read from /proc while the replies decoded: the window's
    # first thread (the GUI's) and the engine's sending thread.
    woken = result["wakeups_per_s"]
    assert "main" in woken["window"] and "engine-send" in woken["engine"]
    rates = [r for side in woken.values() for rate in side.values() for r in rate.values()]
    assert min(rates) >= 0 and max(rates) > 0
    assert set(result["engine_preempted_per_s"]) == {"window", "headless"}
    assert min(result["engine_preempted_per_s"].values()) >= 0

    assert result["layout"] == "floating"
    closed = measure_window(fake_request(tokens=20), new_tokens=20, repeats=1, spec=FAKE,
                            layout="closed")  # fmt: skip
    assert closed["layout"] == "closed" and closed["runs"]["window_decode"]

    transport = measure_transport(keys=2000, tokens=30, paced_tokens=5, rate=100)
    per_token = 4 * 9 * 2000 * 4 / 2**20  # 4 layers x 9 heads x 2,000 float32 keys, in MB
    for mode in ("flood", "paced"):
        assert transport[mode]["mb_per_token"] == pytest.approx(per_token, rel=0.05)
        assert transport[mode]["latency_ms_p50"] <= transport[mode]["latency_ms_max"]


def test_context_switches_count_each_threads_waits_by_its_name():
    from app.server.os_threads import context_switches, name_this_thread, switches_per_s

    if not context_switches(os.getpid()):
        pytest.skip("no /proc here")

    def sleeps() -> int:
        return context_switches(os.getpid()).get("gb-test-sleeper", (0, 0))[0]

    def sleeper() -> None:
        name_this_thread("gb-test-sleeper")
        for _ in range(5):  # each sleep gives the core up: one voluntary switch at least
            time.sleep(0.002)
        finished.wait()  # still there when the counts are read

    finished = threading.Event()
    thread = threading.Thread(target=sleeper)
    before = context_switches(os.getpid())
    thread.start()
    assert wait_until(lambda: sleeps() >= 5)  # counted under its own name
    after = context_switches(os.getpid())
    finished.set()
    thread.join()
    assert "main" in after and after["main"][0] >= before["main"][0]
    rates = switches_per_s(before, after, 2.0)
    assert rates["gb-test-sleeper"][0] == after["gb-test-sleeper"][0] / 2.0 >= 2.5
    assert switches_per_s(before, after, 0.0) == {}


def test_decode_over_wall_time_counts_what_happens_between_steps():
    from app.bench.measures import wall_decode

    ended = Finished("length", "", 100, 0, 11, 0.0, 0.8, 1.0, decode_s=1.5, total_s=3.0)
    assert ended.decode_tokens_per_s == pytest.approx(10 / 1.5)  # the steps' own timer
    assert wall_decode(ended) == pytest.approx(10 / 2.0)  # 0.5 s between the steps counts
    assert wall_decode(replace(ended, generated_tokens=1)) == 0.0


def test_the_paired_interval_holds_the_median_and_narrows_with_more_pairs():
    from app.bench.measures import paired, paired_interval

    assert paired_interval([1.0], [1.0]) is None  # one pair has no spread to resample
    assert paired_interval([0.9] * 5, [1.0] * 5) == [0.9, 0.9]
    noisy = np.random.default_rng(1).normal(0.95, 0.08, 40)
    few = paired_interval(list(noisy[:6]), [1.0] * 6)
    many = paired_interval(list(noisy), [1.0] * 40)
    assert few is not None and many is not None
    assert many[0] <= paired(list(noisy), [1.0] * 40) <= many[1]
    assert many[1] - many[0] < few[1] - few[0]


def test_quitting_while_the_engine_still_imports_does_not_wait_for_it(qtbot):
    slow = EngineSpec(FAKE.loader, FAKE.session_factory, preload=("tests.app.slow_import",))
    worker = EngineClient(EngineProcess(slow))
    started = time.perf_counter()
    worker.shutdown()
    assert time.perf_counter() - started < 2 and not worker.is_running()


def test_bench_stepping_times_next_token_and_a_held_replys_cpu(qapp):
    """--stepping's whole path on the fake session: each press's token drawn, the engine's own
    step beside it, and the CPU of both processes while the reply is held; its window's
    conversations and layout are removed after."""
    from app.bench.stepping import measure_stepping

    def folders() -> set[Path]:
        return set(Path(tempfile.gettempdir()).glob("glassbox-stepping-*"))

    before = folders()
    result = measure_stepping(fake_request(tokens=40), EngineProcess(FAKE), presses=3, paused_s=1)
    assert folders() == before
    assert result["model"] == "fake" and result["presses"] == 3
    assert "TimingPanel" in result["visible_panels"]  # the first start's docked layout
    pressed, step = result["next_token_ms"], result["engine_step_ms"]
    assert 0 < pressed["min"] <= pressed["median"] <= pressed["max"]
    assert 0 <= step["min"] <= step["max"]
    held = result["held"]
    assert held["still_held"] and held["seconds"] >= 1
    assert 0 <= held["engine_cpu_per_s"] < 0.5 and 0 <= held["window_cpu_per_s"] < 1
    selected = result["select_step_ms"]  # eight steps of a second reply, each pulled and drawn
    assert len(result["runs"]["select_step_ms"]) + result["selected_aged_out"] == 8
    assert 0 <= result["selected_fetched"] <= len(result["runs"]["select_step_ms"])
    assert selected is not None and 0 < selected["min"] <= selected["max"]
