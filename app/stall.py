"""How long the GUI event loop stalls while a long reply streams into the whole window.

`measure_gui_stall` builds the window as `glassbox` does (chat, settings, conversations, the
four internals docks, the store, the worker thread), floats the internals docks so each panel
is on screen and redraws, and streams one long reply into it. A 5 ms heartbeat QTimer in the
GUI thread notes when it fires: the longest gap between beats, less the interval, is the
longest time the window could not react to anything.

The reply does not come from a model. A synthetic session yields real engine events with the
bundled model's shapes (SmolLM2-135M: 30 layers, 9 heads, 3 KV heads, head_dim 64; attention
rows for the watched layers as long as the context, KV bytes per layer, the top 10
candidates) as fast as it can, so the measurement loads the GUI, not the model: a real model
on this machine decodes about 25 tokens/s, the synthetic session as fast as the window takes
its events (the worker makes it wait when the window falls behind), some hundreds a second.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.events import Candidate, Event, Finished, ModelInfo, PrefillDone, Token, frozen_array
from engine.kv_cache import formula_bytes
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

SOURCE = "synthetic events, bundled model's shapes"
HEARTBEAT_MS = 5
SETTLE_S = 0.5
STEP_SECONDS = 0.04  # what each Token reports: the bundled model's ~25 tokens/s here

# The bundled model holds 8,192 tokens; the synthetic one may run past that, so that one long
# reply can load the window with as many tokens as asked.
SYNTHETIC_INFO = ModelInfo(
    name="SmolLM2-135M shapes (synthetic)",
    source="bundled",
    architecture="LlamaForCausalLM",
    device="cpu",
    dtype="float32",
    layers=30,
    heads=9,
    kv_heads=3,
    head_dim=64,
    parameters=134_515_008,
    max_context=32_768,
    vocab_size=49152,
    bytes_per_value=4,
)

# Prose with paragraphs, as a reply reads: the chat lays out blocks of realistic length.
PASSAGE = (
    "A transformer reads the whole prompt in one parallel pass, then writes its reply one"
    " token at a time. Each new token looks back at every earlier one through attention,"
    " and the keys and values it needs are kept in a cache, so a step costs one token's"
    " work and not the whole sequence again.\n\nThe cache grows by the same number of bytes"
    " at every step: two tensors per layer, one row per key and value head. Grouped-query"
    " attention lets several query heads share one of those rows, which is why this model"
    " keeps three instead of nine.\n\n"
)


def _pieces() -> list[str]:
    """The passage as word-sized pieces with their leading spaces, newlines kept."""
    pieces: list[str] = []
    for line in PASSAGE.split("\n"):
        words = line.split(" ")
        pieces.extend([words[0], *(" " + w for w in words[1:])] if line else [])
        pieces.append("\n")
    return [p for p in pieces if p]


class SyntheticSession:
    """Honours the ChatSession interface with events shaped like the bundled model's."""

    def __init__(self, info: ModelInfo = SYNTHETIC_INFO, seed: int = 0, delay: float = 0.0) -> None:
        self.info = info
        self.delay = delay  # seconds between tokens (0: as fast as the consumer takes them)
        self._cancel = threading.Event()
        self._rng = np.random.default_rng(seed)
        self._pieces = _pieces()
        vocabulary = sorted(set(self._pieces))
        self._ids = {piece: 1000 + i for i, piece in enumerate(vocabulary)}
        self._candidates = {p: self._top_k(p, vocabulary) for p in vocabulary}
        self._noise: dict[int, np.ndarray] = {}
        self.token_texts: list[str] = []  # the last reply's Token.text, in order
        self.last_kv_bytes = 0

    def cancel(self) -> None:
        self._cancel.set()

    def reset(self) -> None:
        pass

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return sum(len(m.content.split()) + 4 for m in messages) + 1

    def generate(
        self,
        messages: Sequence[Message],
        settings: GenerationSettings | None = None,
        probes: ProbeSettings | None = None,
    ) -> Iterator[Event]:
        settings = settings or GenerationSettings()
        probes = probes or ProbeSettings()
        self._cancel.clear()
        started = time.perf_counter()
        prompt = self.count_tokens(messages)
        layers = tuple(probes.attention_layers)
        self.token_texts = []
        yield self._prefill(prompt, layers, probes)
        reason = "length"
        for index in range(settings.max_new_tokens):
            if self.delay:
                self._cancel.wait(self.delay)
            if self._cancel.is_set():
                reason = "cancelled"
                break
            event = self._token(index, prompt, layers, probes)
            self.token_texts.append(event.text)
            self.last_kv_bytes = event.kv_bytes
            yield event
        generated = len(self.token_texts)
        yield Finished(
            reason=reason,  # type: ignore[arg-type]
            text="".join(self.token_texts),
            prompt_tokens=prompt,
            reused_tokens=0,
            generated_tokens=generated,
            tokenize_s=0.001,
            prefill_s=STEP_SECONDS,
            ttft_s=STEP_SECONDS * 2,
            decode_s=STEP_SECONDS * max(generated - 1, 0),
            total_s=time.perf_counter() - started,
        )

    # -- events -----------------------------------------------------------------------------

    def _kv(self, tokens: int, probes: ProbeSettings) -> tuple[int, tuple[int, ...]]:
        total = formula_bytes(self.info, tokens)
        per_layer = (total // self.info.layers,) * self.info.layers
        return total, per_layer if probes.kv_per_layer else ()

    def _prefill(self, prompt: int, layers: tuple[int, ...], probes: ProbeSettings) -> PrefillDone:
        rows = min(prompt, probes.prefill_rows)
        queries = np.arange(prompt - rows, prompt)[:, None]
        visible = np.arange(prompt)[None, :] <= queries  # the causal mask
        attention = {}
        for layer in layers:
            weights = self._weights(layer, prompt)[:, None, :] * visible
            attention[layer] = frozen_array(weights / weights.sum(axis=2, keepdims=True))
        kv_bytes, per_layer = self._kv(prompt, probes)
        return PrefillDone(
            prompt_tokens=prompt,
            reused_tokens=0,
            processed_tokens=prompt,
            tokenize_s=0.001,
            seconds=STEP_SECONDS,
            kv_bytes=kv_bytes,
            kv_bytes_per_layer=per_layer,
            prompt_token_ids=tuple(range(prompt)),
            token_texts=tuple(f"p{i}" for i in range(prompt)) if layers else (),
            attention=attention,
        )

    def _token(
        self, index: int, prompt: int, layers: tuple[int, ...], probes: ProbeSettings
    ) -> Token:
        piece = self._pieces[index % len(self._pieces)]
        keys = prompt + index  # the query producing token i sees the prompt and i - 1 tokens
        attention = {}
        if index > 0:
            for layer in layers:
                weights = self._weights(layer, keys)
                attention[layer] = frozen_array(weights / weights.sum(axis=1, keepdims=True))
        kv_bytes, per_layer = self._kv(prompt + index + 1, probes)
        return Token(
            index=index,
            token_id=self._ids[piece],
            text=piece,
            piece=piece,
            seconds=STEP_SECONDS * (2 if index == 0 else 1),
            kv_bytes=kv_bytes,
            kv_bytes_per_layer=per_layer,
            attention=attention,
            top_k=self._candidates[piece][: probes.top_k],
        )

    def _weights(self, layer: int, keys: int) -> np.ndarray:
        """Unnormalised [heads, keys]: noise, a sink on the first key, weight on the last few."""
        noise = self._noise.get(layer)
        if noise is None or noise.shape[1] < keys:
            size = max(keys, 1024) * 2
            noise = self._rng.random((self.info.heads, size), dtype=np.float32) ** 4
            self._noise[layer] = noise
        weights = noise[:, :keys].copy()
        weights[:, 0] += 0.2 * keys
        weights[:, -4:] += 0.05 * keys
        return weights

    def _top_k(self, chosen: str, vocabulary: list[str]) -> tuple[Candidate, ...]:
        others = [p for p in vocabulary if p != chosen]
        picks = self._rng.choice(len(others), size=min(9, len(others)), replace=False)
        probs = np.sort(self._rng.dirichlet(np.ones(10)))[::-1]
        texts = [chosen, *(others[i] for i in picks)]
        return tuple(
            Candidate(self._ids[t], t, float(p), 1.0 if rank == 0 else 0.0)  # greedy
            for rank, (t, p) in enumerate(zip(texts, probs, strict=False))
        )


@dataclass
class _Loaded:
    info: ModelInfo
    delay: float = 0.0


def peak_rss_mb() -> int | None:
    """The process's peak resident memory (None where the platform does not say)."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / 2**20 if sys.platform == "darwin" else peak / 2**10)


def stall_statistics(beats: Sequence[float], interval_s: float) -> tuple[float, float]:
    """Longest and 99th-percentile stall in seconds: gaps between beats beyond the interval."""
    if len(beats) < 2:
        return 0.0, 0.0
    stalls = stalls_of(beats, interval_s)
    return float(stalls.max()), float(np.percentile(stalls, 99))


def stalls_of(beats: Sequence[float], interval_s: float) -> np.ndarray:
    """Each gap between heartbeats beyond the interval, in seconds (0 where on time)."""
    return np.maximum(np.diff(np.asarray(beats)) - interval_s, 0.0)


class StallRun:
    """The assembled window on a synthetic session, with its internals docks floating.

    `stream(tokens)` sends one message and returns when the reply is in the chat and every
    panel has drawn its last state; the numbers are in the returned dict. Close it after.
    """

    def __init__(self, folder: Path) -> None:
        from PySide6.QtCore import QSettings

        from app.assembly import assemble
        from app.worker import GenerationWorker

        self.session = SyntheticSession()
        self.worker = GenerationWorker(
            loader=lambda _request, progress: _Loaded(self.session.info),
            session_factory=lambda _loaded: self.session,
        )
        layout = QSettings(str(folder / "layout.ini"), QSettings.Format.IniFormat)
        self.parts = assemble(self.worker, database=folder / "chats.sqlite3", settings=layout)
        self.window = self.parts.window
        self.internals = self.parts.internals
        self.window.show()
        float_docks(self.internals)
        self.redraws = dict.fromkeys(("timing", "kv_cache", "attention", "next_token"), 0)
        for name in self.redraws:
            self._count_redraws(name)
        self.finished: Finished | None = None
        self.largest_batch = 0
        self.window.events_received.connect(self._on_batch)
        self.window.load_model(LoadRequest(spec="synthetic"))
        _run_until(lambda: self.worker.info is not None and not self.worker.busy, 30.0)
        _run_for(SETTLE_S)  # first layout and paint of every window: not part of streaming

    def _count_redraws(self, name: str) -> None:
        panel = getattr(self.internals, name)
        redraw = panel.redraw

        def counted() -> None:
            self.redraws[name] += 1
            redraw()

        panel.redraw = counted

    def _on_batch(self, batch: list[Event]) -> None:
        self.largest_batch = max(self.largest_batch, len(batch))
        for event in batch:
            if isinstance(event, Finished):
                self.finished = event

    def stream(
        self, tokens: int, heartbeat_ms: int = HEARTBEAT_MS, timeout_s: float = 600.0
    ) -> dict[str, Any]:
        from PySide6.QtCore import Qt, QTimer

        self.window.settings_panel.set_settings(
            GenerationSettings(greedy=True, max_new_tokens=tokens)
        )
        self.finished, self.largest_batch = None, 0
        self.redraws = dict.fromkeys(self.redraws, 0)
        beats: list[float] = []
        heartbeat = QTimer()
        heartbeat.setTimerType(Qt.TimerType.PreciseTimer)
        heartbeat.setInterval(heartbeat_ms)
        heartbeat.timeout.connect(lambda: beats.append(time.perf_counter()))
        heartbeat.start()
        started = time.perf_counter()
        if not self.window.send("Write a long essay on how transformers generate text."):
            raise RuntimeError("the window refused to send")
        streamed_s = _run_until(lambda: self.finished is not None, timeout_s) - started
        panels = self.internals.panels
        _run_until(lambda: not any(p.needs_redraw() for p in panels), 10.0)  # the last frame
        heartbeat.stop()
        longest, p99 = stall_statistics(beats, heartbeat_ms / 1000)
        return {
            "source": SOURCE,
            "tokens": self.finished.generated_tokens,
            "longest_stall_ms": round(longest * 1000, 1),
            "p99_stall_ms": round(p99 * 1000, 1),
            "redraws": sum(self.redraws.values()),
            "redraws_per_panel": dict(self.redraws),
            "seconds": round(streamed_s, 2),
            "tokens_per_s": round(self.finished.generated_tokens / streamed_s, 1),
            "largest_batch": self.largest_batch,
            "heartbeat_ms": heartbeat_ms,
            "watched_layers": list(self.window.probe_settings().attention_layers),
            "peak_rss_mb": peak_rss_mb(),  # of the whole process, whatever it did before
        }

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


def synthetic_loader(request: LoadRequest, progress: Callable[[str, float], None]) -> _Loaded:
    """For the engine process (imported there by name): request.extra["delay"] paces tokens."""
    progress("Ready", 1.0)
    return _Loaded(SYNTHETIC_INFO, float(request.extra.get("delay", 0.0)))


def synthetic_session(loaded: _Loaded) -> SyntheticSession:
    return SyntheticSession(loaded.info, delay=loaded.delay)


def _run_for(seconds: float) -> None:
    from PySide6.QtCore import QEventLoop, QTimer

    loop = QEventLoop()
    QTimer.singleShot(round(seconds * 1000), loop.quit)
    loop.exec()


def _run_until(done: Callable[[], bool], timeout_s: float) -> float:
    """Run the event loop until `done()`; returns the time it became true."""
    from PySide6.QtCore import QEventLoop, QTimer

    deadline = time.perf_counter() + timeout_s
    loop = QEventLoop()
    poll = QTimer()
    poll.setInterval(1)

    def check() -> None:
        if done() or time.perf_counter() > deadline:
            loop.quit()

    poll.timeout.connect(check)
    poll.start()
    if not done():
        loop.exec()
    poll.stop()
    if not done():
        raise TimeoutError(f"the window did not get there within {timeout_s:.0f} s")
    return time.perf_counter()


def measure_gui_stall(
    tokens: int = 10_000, heartbeat_ms: int = HEARTBEAT_MS, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Stream a `tokens`-token synthetic reply into the whole window; how long the GUI froze.

    Returns {"source", "tokens", "longest_stall_ms", "p99_stall_ms", "redraws", "seconds", ...}.
    Needs a QApplication's platform: offscreen works (QT_QPA_PLATFORM=offscreen).
    """
    from PySide6.QtCore import qInstallMessageHandler
    from PySide6.QtWidgets import QApplication

    _app = QApplication.instance() or QApplication(["glassbox-bench"])
    previous = qInstallMessageHandler(_quiet_offscreen)
    try:
        with tempfile.TemporaryDirectory(prefix="glassbox-stall-") as folder:
            run = StallRun(Path(folder))
            try:
                return run.stream(tokens, heartbeat_ms, timeout_s)
            finally:
                run.close()
    finally:
        qInstallMessageHandler(previous)


def _quiet_offscreen(_kind: Any, _context: Any, message: str) -> None:
    """Drop the offscreen platform's "This plugin does not support raise()" notes."""
    if not message.startswith("This plugin does not support"):
        print(message, file=sys.stderr)


__all__ = [
    "SOURCE",
    "StallRun",
    "SyntheticSession",
    "float_docks",
    "measure_gui_stall",
    "stall_statistics",
    "stalls_of",
    "synthetic_loader",
    "synthetic_session",
]
