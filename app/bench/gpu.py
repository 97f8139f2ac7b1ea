"""`glassbox bench --device cuda`: the engine's static step against transformers on a GPU.

In one run, interleaved repeat by repeat so drift hits all alike: the fast engine with the
view off and on, `model.generate` with the dynamic cache and with the static cache
(`cache_implementation="static"`, which transformers compiles). The engine records its
step's CUDA graphs from the load on (engine/step/static.py): the load waits for the buckets
up to 1,024 positions (the compile they all share, then captures: `compile_s.engine`), the
first reply is timed, then the rates once the buckets asked for are recorded (`recording_s`,
within RECORDING_WAIT_S). transformers'
compiled step's first reply is timed apart: its wall time is mostly the compile. Without the exact
model (--fast-only: a model too slow to run through generate in the time a check has) the
engine's figures alone. Ratios to the static compiled generate are the targets (bundled
shape >= 1.0x; the view on costing <= 5%); without CUDA the command refuses.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from app.bench.speed import PROMPT, VIEW_ON, engine_run, generate_decode_rate
from engine.events import Finished
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel
from engine.measure.device import synchronize
from engine.settings import Message, ProbeSettings
from engine.text.prompt import encode_chat

NO_CUDA = "glassbox bench --device cuda: no CUDA device here (torch sees none); nothing to measure"
FIRST_REPLY_TOKENS = 8
RECORDING_WAIT_S = 45.0  # the most the bench waits for the engine's graphs before timing


def cuda_missing() -> str | None:
    """The one line the command prints where it cannot run, or None."""
    return None if torch.cuda.is_available() else NO_CUDA


def _timed(run: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def run(
    fast: LoadedModel,
    exact: LoadedModel | None,
    new_tokens: int = 256,
    repeats: int = 5,
    int4: LoadedModel | None = None,
) -> dict[str, Any]:
    """Decode tokens/s (medians) of each path, their ratios, TTFT and the compile times;
    with `int4` (the fast model in CUDA's int4 form), its rate beside the bf16 one's."""
    messages = [Message("user", PROMPT)]
    session = ChatSession(fast)
    first = partial(engine_run, session, messages, FIRST_REPLY_TOKENS, VIEW_ON)
    synchronize(session.device)
    started = time.perf_counter()
    first_reply = first()  # while the step's graphs record in the background
    synchronize(session.device)
    first_reply_s = time.perf_counter() - started
    # the load waited for its buckets' recordings: the one compile they share, then captures
    compile_s: dict[str, float] = {"engine": getattr(fast.compiling, "load_wait_s", 0.0)}
    recording = _recorded(fast, started)
    variants: dict[str, Callable[[], Finished | float]] = {
        "engine": partial(engine_run, session, messages, new_tokens, ProbeSettings.off()),
        "engine_view_on": partial(engine_run, session, messages, new_tokens, VIEW_ON),
    }
    if int4 is not None:
        int4_session = ChatSession(int4)
        engine_run(int4_session, messages, FIRST_REPLY_TOKENS, ProbeSettings.off())
        _recorded(int4, started)
        off = ProbeSettings.off()
        variants["engine_int4"] = partial(engine_run, int4_session, messages, new_tokens, off)
    if exact is not None:
        generate = _generate_variants(exact, messages, new_tokens)
        compile_s["generate_static"] = _timed(generate["generate_static"], _device(exact))
        variants |= generate
    rates, ttft = _interleaved(variants, repeats)
    median = {name: statistics.median(values) for name, values in rates.items()}
    compiling = fast.compiling
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(session.device),
        "model": fast.info.name,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_step": compiling.state if compiling is not None else "eager",
        "decode_tokens_per_s": median,
        "runs": rates,
        "ttft_s": {name: statistics.median(values) for name, values in ttft.items()},
        "first_reply": {"total_s": first_reply_s, "ttft_s": first_reply.ttft_s},
        "compile_s": compile_s,
        "recording": recording,
        "view_on_cost": 1 - median["engine_view_on"] / median["engine"],
        "graph_replay_ms": _replay_ms(fast),
    }
    if exact is not None:
        report["engine_vs_generate_static"] = median["engine"] / median["generate_static"]
    if int4 is not None:
        report["int4_vs_bf16"] = median["engine_int4"] / median["engine"]
    return report


def _recorded(fast: LoadedModel, started: float) -> dict[str, Any]:
    """Wait for the static step's buckets asked for at load: which are ready, whether all,
    and when (seconds since the first reply began)."""
    recorded = getattr(fast.compiling, "recorded", None)
    if recorded is None:
        return {}
    buckets, done = recorded(RECORDING_WAIT_S)
    return {"buckets": buckets, "all_ready": done, "recording_s": time.perf_counter() - started}


def _replay_ms(fast: LoadedModel, replays: int = 200) -> float | None:
    """The first bucket's recorded step replayed back to back, ms each: the device's own time
    for a step, the floor under the engine's (which adds sampling, the host's work, events)."""
    static = getattr(fast.model, "static_step", None)
    if static is None or (replay := static.recorder.ready(static.first)) is None:
        return None
    device = static.table.device  # (the fast model's weights are buffers, no parameters)
    replay()
    synchronize(device)
    started = time.perf_counter()
    for _ in range(replays):
        replay()
    synchronize(device)
    return (time.perf_counter() - started) / replays * 1e3


def _device(loaded: LoadedModel) -> torch.device:
    return next(loaded.model.parameters()).device


def _generate_variants(
    exact: LoadedModel, messages: list[Message], new_tokens: int
) -> dict[str, Callable[[], float]]:
    ids = torch.tensor([encode_chat(exact.tokenizer, messages)], device=_device(exact))
    return {
        "generate_dynamic": partial(generate_decode_rate, exact, ids, new_tokens),
        "generate_static": partial(
            generate_decode_rate, exact, ids, new_tokens, cache_implementation="static"
        ),
    }


def _interleaved(
    variants: dict[str, Callable[[], Finished | float]], repeats: int
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each variant's decode tokens/s per repeat, and the engine's TTFT per repeat."""
    rates: dict[str, list[float]] = {name: [] for name in variants}
    ttft: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, variant in variants.items():
            result = variant()
            if isinstance(result, Finished):
                rates[name].append(result.decode_tokens_per_s)
                ttft.setdefault(name, []).append(result.ttft_s)
            else:
                rates[name].append(result)
    return rates, ttft
