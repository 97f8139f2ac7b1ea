"""Decode speed of the engine against `model.generate`, and of the live view on against off.

All variants run interleaved in one process on the same model, prompt, dtype and device,
greedy, with the same number of new tokens; medians over repeats, reported with their ratios,
because these machines are noisy and only ratios measured together compare.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from engine.device import synchronize
from engine.events import Finished
from engine.loader import LoadedModel
from engine.prompt import encode_chat
from engine.session import ChatSession
from engine.settings import GenerationSettings, Message, ProbeSettings

PROMPT = "Explain in a few paragraphs how a transformer language model generates text."
VIEW_ON = ProbeSettings(attention_layers=(0,), top_k=10)  # what the window asks for by default


def generate_decode_rate(loaded: LoadedModel, ids: torch.Tensor, new_tokens: int) -> float:
    """model.generate's decode tokens/s: (N - 1) tokens over time(N tokens) - time(1 token)."""

    def timed(n: int) -> float:
        synchronize(ids.device)
        start = time.perf_counter()
        loaded.model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=loaded.tokenizer.pad_token_id,
        )  # fmt: skip
        synchronize(ids.device)
        return time.perf_counter() - start

    first, full = timed(1), timed(new_tokens)
    return (new_tokens - 1) / max(full - first, 1e-9)


def engine_run(session: ChatSession, messages, new_tokens: int, probes: ProbeSettings) -> Finished:
    session.reset()
    settings = GenerationSettings(greedy=True, max_new_tokens=new_tokens, ignore_eos=True)
    *_, finished = session.generate(messages, settings, probes)
    return finished


def run(loaded: LoadedModel, new_tokens: int = 64, repeats: int = 5) -> dict[str, Any]:
    session = ChatSession(loaded)
    messages = [Message("user", PROMPT)]
    ids = torch.tensor([encode_chat(loaded.tokenizer, messages)], device=session.device)
    engine_run(session, messages, 4, VIEW_ON)  # warm-up
    generate_decode_rate(loaded, ids, 4)
    rates: dict[str, list[float]] = {"generate": [], "engine": [], "engine_view_on": []}
    ttft: list[float] = []
    for _ in range(repeats):
        rates["generate"].append(generate_decode_rate(loaded, ids, new_tokens))
        rates["engine"].append(
            engine_run(session, messages, new_tokens, ProbeSettings.off()).decode_tokens_per_s
        )
        on = engine_run(session, messages, new_tokens, VIEW_ON)
        rates["engine_view_on"].append(on.decode_tokens_per_s)
        ttft.append(on.ttft_s)
    median = {name: statistics.median(values) for name, values in rates.items()}
    return {
        "model": loaded.info.name,
        "device": loaded.info.device,
        "dtype": loaded.info.dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_tokens_per_s": median,
        "runs": rates,
        "ratio_engine_vs_generate": median["engine"] / median["generate"],
        "view_cost": 1 - median["engine_view_on"] / median["engine"],
        "ttft_s": statistics.median(ttft),
    }
