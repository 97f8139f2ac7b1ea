"""`glassbox bench --window`: what the real window costs the model it shows.

The window is built as `glassbox` builds it (engine process spawned first, then the window,
then the model loaded), offscreen, with the four internals docks floating so that every panel
is on screen and redraws. Then, interleaved, the same greedy reply of the same length to the
same ~1,000-token prompt runs:

- in the window: sent as a user would, every event crossing to the GUI and drawn;
- headless: in the same engine process, on the same loaded model, with the same probes, whose
  events stay in the engine (a Generate with stream=False: only its Finished crosses);
- terminal: in a second engine process that runs as the terminal chat does, while the
  window is idle (TerminalEngine): every core, normal priority, and only what a plain
  `glassbox chat` records (no attention rows, no candidates). The window's engine gives way
  to the window (threads, priority) and records what its panels show; this says what the
  window costs against `glassbox chat`, which the headless replies, run by that same
  engine with the same probes, do not.

Same process, same weights, same torch threads, same probes: the only difference is the
window (pickling and sending the events, and a GUI process busy drawing them on the same
cores), which is what this benchmark is for. A headless run in this (GUI) process would also
measure a second copy of the model, another allocator and thread pool, and would import torch
into the window's process, which it otherwise never does.

The GUI thread's CPU time is read in the GUI thread (time.thread_time) from the first token
shown to the Finished delivered. Event-loop stalls are measured in replies of their own,
one per two pairs: a 5 ms heartbeat QTimer in the GUI thread notes when it fires, from send
to the Finished delivered; each gap between beats beyond 5 ms is time in which the window
could not react to anything (p50, p99 and max over all gaps); stall_own_cpu_ms keeps of
each the GUI thread's own CPU time in it (the rest, it waited: for a core another thread or
process held, or for the interpreter lock). The heartbeat is the benchmark's, not the
window's (heartbeat_cpu_per_s: 200 wake-ups a second), so the replies that are compared with
headless ones, and whose GUI CPU is reported, run without it. The waits for a reply are
woken by its Finished, not by polling, so the benchmark adds no other wake-ups to the
thread it measures or beside the headless engine.

Paired ratios (each window reply over the headless one beside it) come with a 90%
bootstrap interval: on a shared machine one reply's decode speed drifts by 10-15%, and the
interval says how far the run's median can be trusted.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from app.bench.loop import quiet_offscreen, run_for, run_until, wait_for_signal
from app.bench.measures import (
    WindowReply,
    cpu_seconds_of,
    less,
    median,
    median_switches,
    own_stalls,
    paired,
    paired_interval,
    peak_rss_of,
    process_age_s,
    spread,
    stalls_of,
    wall_decode,
)
from app.bench.stall import HEARTBEAT_MS, float_docks, peak_rss_mb
from app.bench.synthetic import PASSAGE
from app.client.engine_client import EngineClient
from app.options import WINDOW_LAYOUTS
from app.server.engine_process import EngineProcess
from app.server.engine_spec import EngineSpec
from app.server.os_threads import Switches, context_switches, switches_per_s
from engine.events import ENGINE_STOPPED, Event, Failed, Finished
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

CONTEXT_TOKENS = 1000  # the prompt's length: the context the panels draw attention over
QUESTION = "Here are some notes on how a language model writes. Summarise them in detail.\n\n"


class WindowBench:
    """The assembled window on the real engine process; see the module docstring."""

    def __init__(
        self, request: LoadRequest, folder: Path, engine: EngineProcess, layout: str = "floating"
    ) -> None:
        """`engine`: spawned as `glassbox` spawns it, before Qt or numpy is imported.
        `layout`: a LAYOUTS name, the docks as the replies are measured."""
        self.engine = engine
        self.started = engine.started_at
        # how long this process ran before the spawn
        self.launch_s = (process_age_s() or 0.0) - (time.perf_counter() - self.started)
        from PySide6.QtCore import QSettings

        from app.window.gui import open_window

        remembered = QSettings(str(folder / "layout.ini"), QSettings.Format.IniFormat)
        self.parts = open_window(
            self.engine,
            database=folder / "chats.sqlite3",
            settings=remembered,
            screen=layout_screen(layout),
        )
        self.worker = self.parts.worker
        self.window = self.parts.window
        arrange_docks(self.parts, layout)
        self.window_shown_s = self._since_launch()
        self.window.load_model(request)
        run_until(lambda: self.worker.info is not None and not self.worker.busy, 600)
        self.model_ready_s = self._since_launch()
        if self.worker.info is None:
            raise RuntimeError("the model did not load")
        self.decode_step_wait_s = settle_decode_step(self.worker)
        ready_at = self.worker.ready_at
        self.engine_ready_s = None if ready_at is None else self.launch_s + ready_at - self.started
        self._reply: WindowReply | None = None
        self._reply_over: Any = None  # ends the wait for the reply in progress
        self.headless_cpu_s: list[float | None] = []
        self.headless_preempted_per_s: list[float] = []
        self.window.events_received.connect(self._on_events)

    def _since_launch(self) -> float:
        return self.launch_s + time.perf_counter() - self.started

    def _on_events(self, batch: list[Event]) -> None:
        reply = self._reply
        if reply is None:  # a headless reply's end, or the warm-up's
            return
        for event in batch:
            reply.on_event(event)
        if reply.finished is not None and self._reply_over is not None:
            self._reply_over()

    def _wait_for_finished(self, reply: WindowReply, heartbeat: Any) -> None:
        """Run the event loop until the reply's Finished is delivered; the heartbeat stops
        right then. Woken by the event itself, not by polling: a 10 ms poll was 100 more
        wake-ups a second of the GUI thread being measured, which the window never has."""
        from PySide6.QtCore import QEventLoop, QTimer

        loop = QEventLoop()

        def over() -> None:
            heartbeat.stop()
            loop.quit()

        self._reply_over = over
        QTimer.singleShot(900_000, loop.quit)  # a reply that never ends fails below
        if reply.finished is None:
            loop.exec()
        self._reply_over = None
        heartbeat.stop()
        if reply.finished is None:
            raise TimeoutError("the window's reply did not finish within 900 s")

    def prompt(self, tokens: int = CONTEXT_TOKENS) -> str:
        """A user message of about `tokens` tokens (counted by the engine's tokenizer)."""
        unit = self._count(PASSAGE) - self._count("")
        return QUESTION + PASSAGE * max(1, math.ceil((tokens - 60) / max(unit, 1)))

    def _count(self, text: str) -> int:
        answers: dict[int, int] = {}

        def on_count(ident: int, tokens: int) -> None:
            answers[ident] = tokens

        self.worker.tokens_counted.connect(on_count)
        ident = self.worker.count_tokens([Message("user", text)])
        run_until(lambda: ident in answers, 60)
        self.worker.tokens_counted.disconnect(on_count)
        return answers[ident]

    def window_reply(
        self, text: str, settings: GenerationSettings, heartbeat: bool = False
    ) -> WindowReply:
        """One reply sent in the window. With `heartbeat`, the 5 ms timer that finds the event
        loop's stalls runs through it: 200 wake-ups a second of the GUI thread that the window
        never has (0.02-0.03 of a core here, and the frame governor counts it), so the replies
        that compare speeds run without it and others measure the stalls."""
        from PySide6.QtCore import Qt, QTimer

        self.window.new_chat()
        # The panel has no ignore_eos switch: its settings are replaced for the benchmark.
        setattr(self.window.settings_panel, "settings", lambda: settings)  # noqa: B010
        internals = self.parts.internals
        reply = WindowReply(
            sent=time.perf_counter(), frames=lambda: internals.frames, switches=self._switches
        )
        beats = QTimer()
        beats.setTimerType(Qt.TimerType.PreciseTimer)
        beats.setInterval(HEARTBEAT_MS)
        beats.timeout.connect(reply.beat)
        self._reply = reply
        if heartbeat:
            beats.start()
        cpu, switches = cpu_seconds_of(self.engine.pid), self._engine_switches()
        if not self.window.send(text):
            raise RuntimeError("the window refused to send")
        self._wait_for_finished(reply, beats)
        self._reply = None
        reply.engine_preempted_per_s = self._preempted_per_s(switches, reply.sent)
        run_until(lambda: not self.worker.busy, 60)
        reply.engine_cpu_s = less(cpu_seconds_of(self.engine.pid), cpu)
        return reply

    def _switches(self) -> dict[str, Switches]:
        return {"window": context_switches(os.getpid()), "engine": self._engine_switches()}

    def _engine_switches(self) -> Switches:
        return context_switches(self.engine.pid) if self.engine.pid is not None else {}

    def _preempted_per_s(self, before: Switches, since: float) -> float:
        """How often a thread of the engine was preempted a second since `since`, all of its
        threads together: with the window drawing beside it, or with nothing (headless)."""
        rates = switches_per_s(before, self._engine_switches(), time.perf_counter() - since)
        return sum(preempted for _woken, preempted in rates.values())

    def idle_cpu_per_s(self, seconds: float = 2.0, heartbeat: bool = True) -> float:
        """GUI-thread CPU per wall second with the window idle, with or without the heartbeat
        running: without it, what an idle window costs; the difference is the heartbeat's own
        cost, which only the stall replies carry."""
        from PySide6.QtCore import Qt, QTimer

        beats: list[float] = []
        timer = QTimer()
        timer.setTimerType(Qt.TimerType.PreciseTimer)
        timer.setInterval(HEARTBEAT_MS)
        timer.timeout.connect(lambda: beats.append(time.perf_counter()))
        if heartbeat:
            timer.start()
        wall, cpu = time.perf_counter(), time.thread_time()
        run_for(seconds)
        timer.stop()
        return (time.thread_time() - cpu) / (time.perf_counter() - wall)

    def messages(self, text: str) -> list[Message]:
        """What the window sends for `text` in a new chat."""
        system = self.window.settings_panel.system_prompt()
        return [*([Message("system", system)] if system else []), Message("user", text)]

    def headless_reply(self, text: str, settings: GenerationSettings) -> Finished:
        messages = self.messages(text)
        probes: ProbeSettings = self.window.probe_settings()
        cpu, switches = cpu_seconds_of(self.engine.pid), self._engine_switches()
        started = time.perf_counter()
        finished = headless(self.worker, messages, settings, probes)
        self.headless_preempted_per_s.append(self._preempted_per_s(switches, started))
        self.headless_cpu_s.append(less(cpu_seconds_of(self.engine.pid), cpu))
        return finished

    def close(self) -> None:
        self.window.close()
        for dock in self.parts.internals.docks.values():
            dock.close()
        self.parts.shutdown()


class TerminalEngine:
    """The same model in an engine of its own that runs as the terminal chat does: every
    core, normal priority (EngineSpec.beside_window=False), recording only what a plain
    chat records. What the window's engine gives up for the window (a core on larger
    machines, priority) and what its probes cost, the comparison with headless replies in
    that engine does not show. Only its Finished crosses; the window stays idle meanwhile."""

    def __init__(self, spec: EngineSpec, request: LoadRequest) -> None:
        own = replace(spec, beside_window=False, threads=None, prefill_threads=None)
        self.worker = EngineClient(EngineProcess(own))
        self.worker.load(request)
        run_until(lambda: self.worker.info is not None and not self.worker.busy, 600)
        if self.worker.info is None:
            raise RuntimeError("the model did not load in the terminal's engine")
        settle_decode_step(self.worker)

    def reply(self, messages: list[Message], settings: GenerationSettings) -> Finished:
        return headless(self.worker, messages, settings, ProbeSettings.for_chat())

    def close(self) -> None:
        self.worker.shutdown()


def headless(
    worker: EngineClient,
    messages: list[Message],
    settings: GenerationSettings,
    probes: ProbeSettings,
) -> Finished:
    """One reply whose events stay in `worker`'s engine (stream=False): only its end crosses,
    in the worker's events. Woken by the Finished, not a poll: a GUI thread polling beside a
    headless engine would take CPU from it (and flatter the window's ratio)."""
    ends: list[Event] = []

    def on_events(batch: list[Event]) -> None:
        ends.extend(event for event in batch if isinstance(event, Failed | Finished))

    worker.reset()
    worker.events.connect(on_events)
    try:
        if not worker.generate(messages, settings, probes, stream=False):
            raise RuntimeError("the engine refused the headless reply")
        wait_for_signal(worker.events, lambda: any(isinstance(e, Finished) for e in ends), 900)
        run_until(lambda: not worker.busy, 60)
    finally:
        worker.events.disconnect(on_events)
    if any(isinstance(e, Failed) and e.error_type == ENGINE_STOPPED for e in ends):
        raise RuntimeError("the engine died during the headless reply")
    finished = ends[-1]
    assert isinstance(finished, Finished)
    return finished


def settle_decode_step(worker: Any) -> float:
    """Wait until a fast model's compiled decode step is attached (built first, in the
    background, if it is not kept), so that every way is timed with it; the seconds waited."""
    info = worker.info
    if info is None or info.precision != "fast":
        return 0.0
    start = time.perf_counter()
    wait_for_signal(worker.decode_step, lambda: worker.decode_step_state, 900)
    return time.perf_counter() - start


LAYOUTS = WINDOW_LAYOUTS


DOCKED_SCREEN = (1600, 1000)  # the docked layouts' window: a desktop monitor's first start


def layout_screen(layout: str) -> Any:
    """The screen the docked layouts are arranged for (None: the platform's own). Offscreen,
    the platform's screen is small, and the first start's layout for a small screen tabs every
    panel into one dock, of which only the front one draws."""
    if layout not in ("docked", "docked-layers"):
        return None
    from PySide6.QtCore import QRect

    return QRect(0, 0, *DOCKED_SCREEN)


def arrange_docks(parts: Any, layout: str) -> None:
    if layout == "floating":
        float_docks(parts.internals)
    elif layout in ("docked", "docked-layers"):
        parts.window.resize(*DOCKED_SCREEN)
        if layout == "docked-layers":  # its tab in front of Attention's: the lens watched
            parts.internals.docks["layers"].raise_()
    elif layout == "closed":
        for dock in parts.internals.docks.values():
            dock.hide()
    else:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def measure_window(
    request: LoadRequest,
    new_tokens: int = 128,
    repeats: int = 3,
    context: int = CONTEXT_TOKENS,
    engine: EngineProcess | None = None,
    spec: EngineSpec | None = None,
    layout: str = "floating",
) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready results (see the module docstring).
    `engine`: already spawned (`glassbox bench` spawns it first, as the app does), else one
    is spawned running `spec` (another session in the engine: tests)."""
    from PySide6.QtCore import qInstallMessageHandler

    previous = qInstallMessageHandler(quiet_offscreen)
    try:
        with tempfile.TemporaryDirectory(prefix="glassbox-window-bench-") as folder:
            bench = WindowBench(request, Path(folder), engine or EngineProcess(spec), layout)
            terminal = None
            try:
                terminal = TerminalEngine(bench.engine.spec, request)
                return {"layout": layout, **_run(bench, terminal, new_tokens, repeats, context)}
            finally:
                if terminal is not None:
                    terminal.close()
                bench.close()
    finally:
        qInstallMessageHandler(previous)


def _run(
    bench: WindowBench, terminal: TerminalEngine, new_tokens: int, repeats: int, context: int
) -> dict[str, Any]:
    text = bench.prompt(context)
    settings = GenerationSettings(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    warm = GenerationSettings(greedy=True, max_new_tokens=4, ignore_eos=True)
    bench.window_reply(text, warm)  # first-time allocations and first paint of every panel
    bench.headless_reply(text, warm)
    terminal.reply(bench.messages(text), warm)
    idle_cpu = bench.idle_cpu_per_s(heartbeat=False)
    heartbeat_cpu = bench.idle_cpu_per_s() - idle_cpu
    windows: list[WindowReply] = []  # compared with headless: no heartbeat
    probed: list[WindowReply] = []  # with the heartbeat, for the stalls
    headless: list[Finished] = []
    terminals: list[Finished] = []
    transport = bench.worker.transport
    sent_before, bytes_before = transport.messages, transport.bytes
    window_seconds = 0.0
    ways = ("window", "headless", "terminal")
    for repeat in range(repeats):  # each way goes first, second and third in turn
        for way in ways[repeat % 3 :] + ways[: repeat % 3]:
            if way == "window":
                reply = bench.window_reply(text, settings)
                windows.append(reply)
                window_seconds += (reply.end or 0.0) - reply.sent
            elif way == "headless":
                headless.append(bench.headless_reply(text, settings))
            else:
                terminals.append(terminal.reply(bench.messages(text), settings))
        if repeat % 2 == 1 or repeats == 1:  # one stall reply per two pairs
            probed.append(bench.window_reply(text, settings, heartbeat=True))
    latencies = np.asarray(transport.latencies_s[sent_before:] or [0.0]) * 1000
    stalls = np.concatenate([stalls_of(r.beats, HEARTBEAT_MS / 1000) for r in probed]) * 1000
    own = np.concatenate([own_stalls(r, HEARTBEAT_MS / 1000) for r in probed]) * 1000
    finished = [r.finished for r in windows if r.finished is not None]
    ends = {"window": finished, "headless": headless, "terminal": terminals}
    decode_runs = {way: [f.decode_tokens_per_s for f in fs] for way, fs in ends.items()}
    ttft_runs = {way: [f.ttft_s for f in fs] for way, fs in ends.items()}
    wall_runs = {way: [wall_decode(f) for f in fs] for way, fs in ends.items()}
    decode = {way: median(runs) for way, runs in decode_runs.items()}
    ttft = {way: median(runs) for way, runs in ttft_runs.items()}
    window_decode, headless_decode = decode_runs["window"], decode_runs["headless"]
    shown_ttft = median([(r.first_token or r.sent) - r.sent for r in windows])
    gui_cpu = [r.gui_cpu_per_s for r in windows]
    window_cpu = [r.window_cpu_per_s for r in windows]
    # The engine's own CPU per reply, both ways: equal means the window adds no work to the
    # engine and any loss of speed is the engine waiting for a core.
    engine_cpu = {
        "window": median([c for c in (r.engine_cpu_s for r in windows) if c is not None]),
        "headless": median([c for c in bench.headless_cpu_s[1:] if c is not None]),
    }
    return {
        "model": bench.worker.info.name if bench.worker.info else None,
        "device": bench.worker.info.device if bench.worker.info else None,
        "prompt_tokens": finished[0].prompt_tokens if finished else 0,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "watched_layers": list(bench.window.probe_settings().attention_layers),
        "decode_tokens_per_s": {k: round(v, 2) for k, v in decode.items()},
        "decode_ratio_window_vs_headless": _ratio(decode["window"], decode["headless"]),
        # Each window reply over the headless one next to it: drift in the machine's load
        # (other jobs on a shared machine) cancels within a pair.
        "decode_ratio_paired_median": paired(window_decode, headless_decode),
        # Where the paired median lies, 90% of the time: how far one run's figure can be
        # trusted on a machine whose speed drifts (bootstrap over the pairs).
        "decode_ratio_paired_ci90": paired_interval(window_decode, headless_decode),
        # The same over the wall time after the first token: the steps' own timer leaves out
        # what happens between two steps (events handed over, a wait for a GUI that is behind).
        "decode_wall_tokens_per_s": {k: round(median(v), 2) for k, v in wall_runs.items()},
        "decode_wall_ratio_paired_median": paired(wall_runs["window"], wall_runs["headless"]),
        "ttft_s": {k: round(v, 3) for k, v in ttft.items()},
        "ttft_ratio_window_vs_headless": _ratio(ttft["window"], ttft["headless"]),
        # Against the terminal's engine, every core decoding (TerminalEngine): where a user
        # comparing the window with `glassbox chat` meets it.
        "decode_ratio_window_vs_terminal": _ratio(decode["window"], decode["terminal"]),
        "decode_ratio_window_vs_terminal_paired_ci90": paired_interval(
            window_decode, decode_runs["terminal"]
        ),
        "ttft_ratio_window_vs_terminal": _ratio(ttft["window"], ttft["terminal"]),
        "ttft_ratio_paired_median": paired(ttft_runs["window"], ttft_runs["headless"]),
        "ttft_ratio_paired_ci90": paired_interval(ttft_runs["window"], ttft_runs["headless"]),
        "ttft_shown_s": round(shown_ttft, 3),  # send pressed -> first token in the chat
        "runs": {
            **{f"{way}_decode": [round(v, 2) for v in runs] for way, runs in decode_runs.items()},
            **{f"{way}_ttft": [round(v, 3) for v in runs] for way, runs in ttft_runs.items()},
            **{f"{way}_decode_wall": [round(v, 2) for v in vs] for way, vs in wall_runs.items()},
            "gui_cpu_per_s": [round(c, 3) for c in gui_cpu],
            "frames_per_s": [round(r.frames_per_s, 2) for r in windows],
        },
        "gui_cpu_per_s": round(median(gui_cpu), 3),
        "window_process_cpu_per_s": round(median(window_cpu), 3),
        # How often the panels redrew while the model streamed: the frame-rate governor keeps
        # the GUI thread near its share of a core (ui.panels.docks), between 2 and 30 a second.
        "panel_frames_per_s": round(median([r.frames_per_s for r in windows]), 2),
        # The window idle (no reply, no heartbeat): what it costs when nothing happens.
        "gui_cpu_idle_per_s": round(idle_cpu, 3),
        # What the 5 ms heartbeat of the stall replies costs the GUI thread on its own.
        "heartbeat_cpu_per_s": round(heartbeat_cpu, 3),
        "stall_replies": len(probed),
        "engine_cpu_s_per_reply": {k: round(v, 2) for k, v in engine_cpu.items()},
        # Each thread's wake-ups and preemptions a second from the first token to the end, in
        # both processes: each time one of the window's threads runs on two cores it takes a
        # core from one of the engine's, steadier to read than the decode ratio it moves.
        "wakeups_per_s": median_switches([r.switches_per_s for r in windows]),
        # The engine's threads preempted a second over whole replies, beside the window and
        # headless (the warm-up left out).
        "engine_preempted_per_s": {
            "window": round(median([r.engine_preempted_per_s or 0.0 for r in windows]), 1),
            "headless": round(median(bench.headless_preempted_per_s[1:]), 1),
        },
        "stall_ms": spread(stalls),
        # Of each stall, the part the GUI thread spent running (its CPU time in the gap): the
        # window's own work. The rest it waited for a core, which another process held.
        "stall_own_cpu_ms": spread(own),
        "transport": {
            "messages": transport.messages - sent_before,
            "mb_per_s": round((transport.bytes - bytes_before) / 2**20 / window_seconds, 2)
            if window_seconds
            else 0.0,
            "latency_ms_p50": round(float(np.percentile(latencies, 50)), 2),
            "latency_ms_p99": round(float(np.percentile(latencies, 99)), 2),
        },
        "start_s": {
            "window_shown": round(bench.window_shown_s, 2),
            "engine_imported": round(bench.engine_ready_s, 2) if bench.engine_ready_s else None,
            "model_ready": round(bench.model_ready_s, 2),
        },
        "decode_step": bench.worker.decode_step_state,
        "decode_step_wait_s": round(bench.decode_step_wait_s, 1),
        "peak_rss_mb": {"gui": peak_rss_mb(), "engine": peak_rss_of(bench.engine.pid)},
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": sys.version.split()[0],
    }
