"""What a placement costs, measured: the same model placed and in memory, replies alternated
round by round in one process, and each placed decode step's transfer against what the load
predicted (`glassbox bench --placement`).

With `evict`, every page of the fast model's disk-placed layers is dropped from the page cache
between steps (outside the step's clock), as the OS does when memory runs short: what a step
costs where the file must really be read back. Without it, the steps meet the page cache as
the machine has it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from app.bench.speed import PROMPT, VIEW_ON, peak_rss_mb, wait_for_compiled
from engine.events import Event, Finished, Placement, Token
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel
from engine.placement import mapped
from engine.settings import GenerationSettings, Message

Between = Callable[[], None]  # run between two steps, outside their clocks


def run(
    placed: LoadedModel,
    in_memory: LoadedModel | None,
    new_tokens: int = 32,
    repeats: int = 3,
    evict: bool = False,
) -> dict[str, Any]:
    """Decode speed of `placed` against `in_memory` (None: placed alone, a model that does
    not fit), and its steps' measured transfer and time against the predictions."""
    placement = placed.info.placement
    if placement is None:
        raise ValueError("bench --placement needs a placed load (--max-memory or --device-map)")
    between = _evicting(placed) if evict else None
    compiled = wait_for_compiled(in_memory) if in_memory is not None else None
    sessions = {"placed": ChatSession(placed)}
    if in_memory is not None:
        sessions["in_memory"] = ChatSession(in_memory)
    for session in sessions.values():  # warm-up
        _reply(session, 4, None)
    variants = dict(sessions)
    if in_memory is not None and getattr(in_memory.model, "decode_step", None) is not None:
        variants["in_memory_eager"] = sessions["in_memory"]  # what a placed model runs
    rates: dict[str, list[float]] = {name: [] for name in variants}
    steps: list[dict[str, float]] = []
    for _ in range(repeats):
        for name, session in variants.items():
            with _eager(session.model, name == "in_memory_eager"):
                finished, tokens = _reply(
                    session, new_tokens, between if name == "placed" else None
                )
            rates[name].append(finished.decode_tokens_per_s)
            if name == "placed":
                speed = placement.read_bytes_per_s
                steps.extend(_step(t, speed) for t in tokens if t.transfer is not None)
    return _report(placed, placement, rates, steps, compiled, new_tokens, repeats, evict)


@contextlib.contextmanager
def _eager(model: torch.nn.Module, eager: bool) -> Iterator[None]:
    """The fast model with its compiled decode step set aside (when `eager`)."""
    step = getattr(model, "decode_step", None)
    if eager:
        setattr(model, "decode_step", None)  # noqa: B010  (a GGUFLlama attribute)
    try:
        yield
    finally:
        if eager:
            setattr(model, "decode_step", step)  # noqa: B010


def _reply(
    session: ChatSession, new_tokens: int, between: Between | None
) -> tuple[Finished, list[Token]]:
    session.reset()
    settings = GenerationSettings(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    tokens: list[Token] = []
    finished = None
    for event in _paused(session.generate([Message("user", PROMPT)], settings, VIEW_ON), between):
        if isinstance(event, Token):
            tokens.append(event)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return finished, tokens


def _paused(events: Iterator[Event], between: Between | None) -> Iterator[Event]:
    """The events, with `between` run after each token: the generator is suspended there, so
    nothing it does is on a step's clock."""
    for event in events:
        yield event
        if between is not None and isinstance(event, Token):
            between()


def _evicting(placed: LoadedModel) -> Between:
    meter = placed.transfers
    if not isinstance(meter, mapped.MappedMeter):
        raise ValueError("--evict drops the fast model's mapped pages: load it at fast precision")
    return meter.drop_all


def _step(token: Token, read_bytes_per_s: float) -> dict[str, float]:
    transfer = token.transfer
    assert transfer is not None
    return {
        "step_s": token.seconds,
        "transfer_s": transfer.seconds,
        "bytes": transfer.bytes,
        "predicted_transfer_s": transfer.predicted_s,
        "predicted_step_s": transfer.predicted_step_s,
        "predicted_bytes": transfer.predicted_s * read_bytes_per_s,
    }


def _bytes_ratio(steps: list[dict[str, float]], moved: int) -> float | None:
    """The median step's bytes read against those placed on disk."""
    if not steps or not moved:
        return None
    return statistics.median(s["bytes"] for s in steps) / moved


def _report(
    placed: LoadedModel, placement: Placement, rates: dict[str, list[float]],
    steps: list[dict[str, float]], compiled: dict[str, Any] | None, new_tokens: int,
    repeats: int, evict: bool,
) -> dict[str, Any]:  # fmt: skip
    median = {name: statistics.median(values) for name, values in rates.items()}

    def ratio(top: str, bottom: str) -> float | None:
        values = [s[top] / s[bottom] for s in steps if s[bottom] > 0]
        return statistics.median(values) if values else None

    report: dict[str, Any] = {
        "model": placed.info.name,
        "precision": placed.info.precision,
        "threads": torch.get_num_threads(),
        "note": placement.note,
        "evict": evict,
        "place_bytes": dict(placement.place_bytes),
        "layer_places": list(placement.layer_places),
        "moved_bytes": placement.moved_bytes,
        "read_bytes_per_s_at_load": placement.read_bytes_per_s,
        "compute_s_at_load": placement.compute_s,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_tokens_per_s": median,
        "runs": rates,
        "steps": len(steps),
        "median_step_s": statistics.median(s["step_s"] for s in steps) if steps else None,
        "median_bytes_read": statistics.median(s["bytes"] for s in steps) if steps else None,
        "step_vs_predicted": ratio("step_s", "predicted_step_s"),
        "transfer_vs_predicted": ratio("transfer_s", "predicted_transfer_s"),
        "bytes_read_vs_moved": _bytes_ratio(steps, placement.moved_bytes),
        # what the steps read against what they found missing (the prediction's bytes)
        "bytes_read_vs_missing": ratio("bytes", "predicted_bytes"),
        "peak_rss_mb": peak_rss_mb(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if "in_memory" in median:
        report["ratio_placed_vs_in_memory"] = median["placed"] / median["in_memory"]
    if "in_memory_eager" in median:
        report["ratio_placed_vs_in_memory_eager"] = median["placed"] / median["in_memory_eager"]
        report["in_memory_decode_step"] = compiled
    return report
