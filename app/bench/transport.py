"""`glassbox bench --window`'s channel figures: what the engine-to-window channel carries at a
long context, through the real engine process and receiving thread (no window drawing)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from app.bench.loop import run_until
from app.bench.synthetic import SYNTHETIC_LOADER, SYNTHETIC_SESSION
from app.client.engine_client import EngineClient
from app.server.engine_process import EngineProcess
from app.server.engine_spec import EngineSpec
from engine.events import Event, Finished
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings


def measure_transport(
    keys: int = 10_000, tokens: int = 300, paced_tokens: int = 75, rate: float = 25.0
) -> dict[str, Any]:
    """What the engine-to-window channel carries at `keys` keys: synthetic events with the
    bundled model's shapes (4 watched layers x 9 heads x `keys` floats per token), through the
    real engine process and receiving thread into the worker's delivery (no window drawing).

    "flood": as fast as the channel takes them; "paced": `rate` tokens a second, as a model
    would send them. Latency: from the event queued in the engine to unpickled in the GUI
    process (delivery to the window then waits for the next ~30 Hz frame, by design).
    """
    from PySide6.QtWidgets import QApplication

    _app = QApplication.instance() or QApplication(["glassbox-bench"])
    spec = EngineSpec(SYNTHETIC_LOADER, SYNTHETIC_SESSION, preload=())
    probes = ProbeSettings(attention_layers=(0, 9, 19, 29), top_k=10, prefill_rows=1)
    prompt = [Message("user", " ".join(["w"] * (keys - 5)))]  # the synthetic count: keys
    results: dict[str, Any] = {"keys": keys, "floats_per_token": 4 * 9 * keys}
    for mode, count, delay in (("flood", tokens, 0.0), ("paced", paced_tokens, 1 / rate)):
        worker = EngineClient(EngineProcess(spec))
        try:
            results[mode] = _channel_run(worker, prompt, probes, count, delay)
        finally:
            worker.shutdown()
    return results


def _channel_run(
    worker: EngineClient, prompt: list[Message], probes: ProbeSettings, tokens: int, delay: float
) -> dict[str, Any]:
    """One reply of `tokens` synthetic tokens, `delay` s apart, through `worker`'s channel."""
    worker.load(LoadRequest("synthetic", extra={"delay": str(delay)}))
    run_until(lambda: worker.info is not None and not worker.busy, 60)
    ends: list[Finished] = []

    def on_events(batch: list[Event]) -> None:
        ends.extend(event for event in batch if isinstance(event, Finished))

    worker.events.connect(on_events)
    before = (worker.transport.bytes, len(worker.transport.latencies_s))
    started = time.perf_counter()
    worker.generate(prompt, GenerationSettings(greedy=True, max_new_tokens=tokens), probes)
    run_until(lambda: bool(ends), 600)
    seconds = time.perf_counter() - started
    sent = worker.transport.bytes - before[0]
    latency = np.asarray(worker.transport.latencies_s[before[1] :]) * 1000
    generated = ends[0].generated_tokens
    return {
        "tokens": generated,
        "tokens_per_s": round(generated / seconds, 1),
        "mb_per_s": round(sent / 2**20 / seconds, 1),
        "mb_per_token": round(sent / 2**20 / max(generated, 1), 3),
        "latency_ms_p50": round(float(np.percentile(latency, 50)), 2),
        "latency_ms_p99": round(float(np.percentile(latency, 99)), 2),
        "latency_ms_max": round(float(latency.max()), 2),
    }
