"""How long the GUI event loop stalls while a long reply streams into the whole window.

`measure_gui_stall` builds the window as `glassbox` does (chat, settings, conversations, the
four internals docks, the store, the engine client, here on a server thread), floats the
internals docks so each panel is on screen and redraws, and streams one long reply into it. A
5 ms heartbeat QTimer in the GUI thread notes when it fires: the longest gap between beats,
less the interval, is the longest time the window could not react to anything.

The reply does not come from a model. app.bench.synthetic's session yields real engine events with
the bundled model's shapes (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head_dim 64; attention
rows for the watched layers as long as the context, KV bytes per layer, the top 10
candidates) as fast as it can, so the measurement loads the GUI, not the model: a real model
on this machine decodes about 25 tokens/s, the synthetic session as fast as the window takes
its events (the worker makes it wait when the window falls behind), some hundreds a second.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from app.bench.loop import quiet_offscreen, run_for, run_until
from app.bench.measures import less, stall_statistics, stalls_of
from app.bench.synthetic import (
    SYNTHETIC_LOADER,
    SYNTHETIC_SESSION,
    SyntheticLoaded,
    SyntheticSession,
)
from app.server.engine_spec import EngineSpec
from app.server.engine_thread import EngineThread
from app.server.os_threads import thread_cpu_s
from app.server.outbox import SENDER_THREAD
from engine.events import Event, Finished, StepRows, Token
from engine.settings import GenerationSettings, LoadRequest

SOURCE = "synthetic events, bundled model's shapes"
HEARTBEAT_MS = 5
SETTLE_S = 0.5


def peak_rss_mb() -> int | None:
    """The process's peak resident memory (None where the platform does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 2**20 if sys.platform == "darwin" else peak / 2**10)


class StallRun:
    """The assembled window on a synthetic session, with its internals docks floating.

    `stream(tokens)` sends one message and returns when the reply is in the chat and every
    panel has drawn its last state; the numbers are in the returned dict. Close it after.
    """

    def __init__(
        self, folder: Path, delay: float = 0.0, pipe: bool = False, rows_per_token: bool = False
    ) -> None:
        """`delay`: seconds the session waits before each token (0: as fast as taken).
        `pipe`: the session runs in an engine process, its events crossing the app's real
        pipe (else in a server thread of this process). `rows_per_token`: every token carries
        its attention rows, as before the view pulled them (a baseline to compare with)."""
        from PySide6.QtCore import QSettings

        from app.client.engine_client import EngineClient
        from app.window.assembly import assemble
        from ui.panels.docks import DOCKS

        self.engine_pid: int | None = None
        self.session: SyntheticSession | None = None  # in this process only (not piped)
        if pipe:
            from app.server.engine_process import EngineProcess

            spec = EngineSpec(SYNTHETIC_LOADER, SYNTHETIC_SESSION, preload=())
            process = EngineProcess(spec)
            self.engine_pid = process.pid
            self.worker = EngineClient(process)
        else:
            session = self.session = SyntheticSession(delay=delay)
            self.worker = EngineClient(
                EngineThread(
                    loader=lambda _request, progress: SyntheticLoaded(session.info),
                    session_factory=lambda _loaded: session,
                )
            )
        layout = QSettings(str(folder / "layout.ini"), QSettings.Format.IniFormat)
        self.parts = assemble(self.worker, database=folder / "chats.sqlite3", settings=layout)
        self.window = self.parts.window
        self.internals = self.parts.internals
        if rows_per_token:
            probes = self.window.probe_settings()
            self.window.set_probe_settings(replace(probes, token_rows=True))
        self.window.show()
        float_docks(self.internals)
        names = [name for _object_name, _title, name in DOCKS]
        self.redraws = dict.fromkeys(names, 0)
        self.redraw_cpu_s = dict.fromkeys(names, 0.0)  # the GUI thread's, in redraw()
        for name in names:
            self._count_redraws(name)
        self.finished: Finished | None = None
        self.largest_batch = 0
        self.tokens_shown = 0
        self.rows_shown = 0
        self.first_shown = self.last_shown = 0.0  # when the first and the latest Token came
        self.window.events_received.connect(self._on_batch)
        self.window.load_model(LoadRequest(spec="synthetic", extra={"delay": str(delay)}))
        run_until(lambda: self.worker.info is not None and not self.worker.busy, 30.0)
        run_for(SETTLE_S)  # first layout and paint of every window: not part of streaming

    def _count_redraws(self, name: str) -> None:
        panel = getattr(self.internals, name)
        redraw = panel.redraw

        def counted() -> None:
            self.redraws[name] += 1
            started = time.thread_time()
            try:
                redraw()
            finally:
                self.redraw_cpu_s[name] += time.thread_time() - started

        panel.redraw = counted

    def _on_batch(self, batch: list[Event]) -> None:
        self.largest_batch = max(self.largest_batch, len(batch))
        shown = self.tokens_shown
        for event in batch:
            if isinstance(event, Finished):
                self.finished = event
            elif isinstance(event, Token):
                self.tokens_shown += 1
            elif isinstance(event, StepRows):
                self.rows_shown += 1
        if self.tokens_shown > shown:  # once a batch: the time it was handed to the window
            now = time.perf_counter()
            self.first_shown = self.first_shown if shown else now
            self.last_shown = now

    def stream(
        self, tokens: int, heartbeat_ms: int = HEARTBEAT_MS, timeout_s: float = 600.0
    ) -> dict[str, Any]:
        from PySide6.QtCore import Qt, QTimer

        self.window.settings_panel.set_settings(
            GenerationSettings(greedy=True, max_new_tokens=tokens)
        )
        self.finished, self.largest_batch = None, 0
        self.tokens_shown = self.rows_shown = 0
        self.first_shown = self.last_shown = 0.0
        self.redraws = dict.fromkeys(self.redraws, 0)
        self.redraw_cpu_s = dict.fromkeys(self.redraw_cpu_s, 0.0)
        sender_before = self._sender_cpu_s()
        cpu_before = time.process_time()
        beats: list[float] = []
        heartbeat = QTimer()
        heartbeat.setTimerType(Qt.TimerType.PreciseTimer)
        heartbeat.setInterval(heartbeat_ms)
        heartbeat.timeout.connect(lambda: beats.append(time.perf_counter()))
        heartbeat.start()
        started = time.perf_counter()
        if not self.window.send("Write a long essay on how transformers generate text."):
            raise RuntimeError("the window refused to send")
        streamed_s = run_until(lambda: self.finished is not None, timeout_s) - started
        window_cpu_s = time.process_time() - cpu_before
        sender_s = less(self._sender_cpu_s(), sender_before)
        panels = self.internals.panels
        run_until(lambda: not any(p.needs_redraw() for p in panels), 10.0)  # the last frame
        heartbeat.stop()
        longest, p99 = stall_statistics(beats, heartbeat_ms / 1000)
        tokens = self.finished.generated_tokens if self.finished is not None else 0
        return {
            "source": SOURCE,
            "tokens": tokens,
            "longest_stall_ms": round(longest * 1000, 1),
            "p99_stall_ms": round(p99 * 1000, 1),
            "redraws": sum(self.redraws.values()),
            "redraws_per_panel": dict(self.redraws),
            # What each panel's redraws took of the GUI thread (its paint comes after, in the
            # event loop, and is not in it): where the window's frames spend their time.
            "redraw_cpu_ms_per_panel": {
                name: round(seconds * 1000, 1) for name, seconds in self.redraw_cpu_s.items()
            },
            "seconds": round(streamed_s, 3),  # a short run lasts well under 0.1 s
            "tokens_per_s": round(tokens / streamed_s, 1),  # from sending to the reply's end
            # from the first token shown to the last: the engine's rate as the window saw it
            "shown_tokens_per_s": self._shown_rate(),
            "largest_batch": self.largest_batch,
            "heartbeat_ms": heartbeat_ms,
            "watched_layers": list(self.window.probe_settings().attention_layers),
            "peak_rss_mb": peak_rss_mb(),  # of the whole process, whatever it did before
            "tokens_shown": self.tokens_shown,  # Token events the window took in
            "rows_shown": self.rows_shown,  # StepRows: the latest rows a panel drew
            "window_cpu_per_s": round(window_cpu_s / streamed_s, 3),
            # The engine's thread that writes its replies to the pipe (engine_pid: piped only)
            "engine_sender_cpu_per_s": round(sender_s / streamed_s, 3)
            if sender_s is not None
            else None,
            "through_pipe": self.engine_pid is not None,
        }

    def _shown_rate(self) -> float | None:
        span = self.last_shown - self.first_shown
        return round((self.tokens_shown - 1) / span, 1) if span > 0 else None

    def _sender_cpu_s(self) -> float | None:
        if self.engine_pid is None:
            return None
        return thread_cpu_s(self.engine_pid, SENDER_THREAD)

    def close(self) -> None:
        self.window.close()
        for dock in self.internals.docks.values():
            dock.close()
        self.parts.shutdown()


def float_docks(internals: Any) -> None:
    """Every internals dock floating and shown: tabbed docks behind others never redraw."""
    for dock in internals.docks.values():
        dock.setFloating(True)
        dock.resize(720, 460)
        dock.show()


def measure_gui_stall(
    tokens: int = 10_000,
    heartbeat_ms: int = HEARTBEAT_MS,
    timeout_s: float = 600.0,
    tokens_per_s: float = 0.0,
    pipe: bool = False,
    rows_per_token: bool = False,
) -> dict[str, Any]:
    """Stream a `tokens`-token synthetic reply into the whole window; how long the GUI froze.
    `tokens_per_s` paces the session (1,000: a GPU engine's rate); 0, as fast as taken.
    `pipe`: the session in an engine process, its events through the app's pipe.
    `rows_per_token`: every token carries its rows (the contract before the view pulled them).

    Returns {"source", "tokens", "longest_stall_ms", "p99_stall_ms", "redraws", "seconds", ...}.
    Needs a QApplication's platform: offscreen works (QT_QPA_PLATFORM=offscreen).
    """
    from PySide6.QtCore import qInstallMessageHandler
    from PySide6.QtWidgets import QApplication

    _app = QApplication.instance() or QApplication(["glassbox-bench"])
    previous = qInstallMessageHandler(quiet_offscreen)
    try:
        with tempfile.TemporaryDirectory(prefix="glassbox-stall-") as folder:
            delay = 1 / tokens_per_s if tokens_per_s else 0.0
            run = StallRun(Path(folder), delay, pipe, rows_per_token)
            try:
                result = run.stream(tokens, heartbeat_ms, timeout_s)
                return {**result, "paced_at": tokens_per_s, "rows_per_token": rows_per_token}
            finally:
                run.close()
    finally:
        qInstallMessageHandler(previous)


__all__ = [
    "SOURCE",
    "StallRun",
    "float_docks",
    "measure_gui_stall",
    "stall_statistics",
    "stalls_of",
]
