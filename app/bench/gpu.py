"""`glassbox bench --device cuda`: the engine's static step against transformers on a GPU.

In one run, interleaved repeat by repeat so drift hits all alike: the fast engine with the
view off and on, `model.generate` with the dynamic cache and with the static cache
(`cache_implementation="static"`, which transformers compiles). The first reply of each
compiled path is timed apart as its compile time. Ratios to the static compiled generate are
the issue's targets (bundled shape >= 1.0x, aiming at >= 1,000 tok/s on an H100; the view on
costing <= 5%): they wait for a GPU to be measured; without CUDA the command refuses.
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
    fast: LoadedModel, exact: LoadedModel, new_tokens: int = 256, repeats: int = 5
) -> dict[str, Any]:
    """Decode tokens/s (medians) of each path, their ratios, and the compile times."""
    messages = [Message("user", PROMPT)]
    session = ChatSession(fast)
    model: Any = exact.model
    device = next(model.parameters()).device
    ids = torch.tensor([encode_chat(exact.tokenizer, messages)], device=device)
    static = partial(generate_decode_rate, exact, ids, new_tokens, cache_implementation="static")
    off = partial(engine_run, session, messages, new_tokens, ProbeSettings.off())
    compile_s = {  # the first reply records the step's graphs; transformers compiles its own
        "engine": _timed(partial(engine_run, session, messages, 8, VIEW_ON), session.device),
        "generate_static": _timed(static, device),
    }
    variants: dict[str, Callable[[], Finished | float]] = {
        "engine": off,
        "engine_view_on": partial(engine_run, session, messages, new_tokens, VIEW_ON),
        "generate_dynamic": partial(generate_decode_rate, exact, ids, new_tokens),
        "generate_static": static,
    }
    rates: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, variant in variants.items():
            result = variant()
            rates[name].append(
                result.decode_tokens_per_s if isinstance(result, Finished) else result
            )
    median = {name: statistics.median(values) for name, values in rates.items()}
    compiling = fast.compiling
    return {
        "device": torch.cuda.get_device_name(device),
        "model": fast.info.name,
        "new_tokens": new_tokens,
        "decode_step": compiling.state if compiling is not None else "eager",
        "decode_tokens_per_s": median,
        "runs": rates,
        "compile_s": compile_s,
        "engine_vs_generate_static": median["engine"] / median["generate_static"],
        "view_on_cost": 1 - median["engine_view_on"] / median["engine"],
    }
