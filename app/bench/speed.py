"""Decode speed of the engine in exact and fast precision against `model.generate`, the live
view on against off, prefill, a long-context step against what its bytes predict, and
llama.cpp on the same GGUF when `llama_cpp` is importable.

All variants run interleaved in one process on the same model, prompt and device, greedy,
with the same number of new tokens; medians over repeats, reported with their ratios,
because these machines are noisy and only ratios measured together compare.
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from app.bench import llama_cpp_peer
from app.bench.llama_cpp_peer import LlamaCppPeer, PeerFailed
from engine.events import Finished
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel
from engine.measure.device import synchronize
from engine.model.decoder import decoder_for
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.step.compiled import NOT_COMPILED
from engine.text.prompt import encode_chat

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from engine.model.llama import GGUFLlama


PROMPT = "Explain in a few paragraphs how a transformer language model generates text."
# The live view's probes as the window asks for them: a layer's attention (its rows kept in
# the session's ring, each token carrying its per-head statistics) and the top 10 candidates
VIEW_ON = ProbeSettings(attention_layers=(0,), top_k=10, token_rows=False)
PREFILL_TOKENS = 500
LONG_CONTEXT = 5000  # tokens of context for the long-context step
STEPS = 16  # decode steps timed at each context length
VIEW_ON_SUFFIX = "_view_on"  # a variant with the view on, beside its name without it


def generate_decode_rate(
    loaded: LoadedModel, ids: torch.Tensor, new_tokens: int, **options: Any
) -> float:
    """model.generate's decode tokens/s: (N - 1) tokens over time(N tokens) - time(1 token);
    `options` go to generate (cache_implementation="static": transformers' compiled step)."""

    # The exact model: a transformers causal LM. Read as Any: transformers versions type
    # generate's `self` differently (a Protocol its own models do not satisfy, in some).
    model: Any = loaded.model

    def timed(n: int) -> float:
        synchronize(ids.device)
        start = time.perf_counter()
        model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
            pad_token_id=loaded.tokenizer.pad_token_id, **options,
        )  # fmt: skip
        synchronize(ids.device)
        return time.perf_counter() - start

    first, full = timed(1), timed(new_tokens)
    return (new_tokens - 1) / max(full - first, 1e-9)


def engine_run(
    session: ChatSession,
    messages: Sequence[Message],
    new_tokens: int,
    probes: ProbeSettings,
    sampled: bool = False,
) -> Finished:
    """One reply, greedy, or `sampled` as the chat samples by default (seeded)."""
    session.reset()
    settings = GenerationSettings(
        greedy=not sampled, seed=0, max_new_tokens=new_tokens, ignore_eos=True
    )
    *_, finished = session.generate(messages, settings, probes)
    assert isinstance(finished, Finished)  # a generation always ends with its Finished
    return finished


def run(
    loaded: LoadedModel | None,
    new_tokens: int = 64,
    repeats: int = 5,
    fast: LoadedModel | None = None,
    gguf_path: str | None = None,
    long_context: int = LONG_CONTEXT,
) -> dict[str, Any]:
    """`loaded` is the exact model (the one `generate` runs), or None to measure the fast one
    alone (a model too large or too slow in float32); `fast` the same GGUF in fast precision,
    if it can run; `gguf_path` the file llama.cpp reads, if installed."""
    messages = [Message("user", PROMPT)]
    compiled = wait_for_compiled(fast) if fast is not None else None
    any_model = loaded or fast
    assert any_model is not None, "the benchmark needs a model"
    ids = torch.tensor([encode_chat(any_model.tokenizer, messages)])
    sessions = {}
    if loaded is not None:
        sessions["engine"] = ChatSession(loaded)
    if fast is not None:
        sessions["fast"] = ChatSession(fast)
    peer, peer_note = _llama_cpp(gguf_path, ids[0].tolist()) if gguf_path else (None, None)

    variants: dict[str, Callable[[], Finished | float]] = {}
    if loaded is not None:
        exact_ids = ids.to(cast("PreTrainedModel", loaded.model).device)
        variants["generate"] = lambda: generate_decode_rate(loaded, exact_ids, new_tokens)
    for name, session in sessions.items():
        variants[name] = partial(engine_run, session, messages, new_tokens, ProbeSettings.off())
        variants[name + VIEW_ON_SUFFIX] = partial(
            engine_run, session, messages, new_tokens, VIEW_ON
        )
    main = "fast" if fast is not None else "engine"  # the path the chat takes
    variants[f"{main}_sampled"] = partial(
        engine_run, sessions[main], messages, new_tokens, ProbeSettings.off(), sampled=True
    )
    if compiled is not None and compiled["decode_step"] == "compiled":
        variants["fast_eager"] = partial(eager_run, sessions["fast"], messages, new_tokens)
    if peer is not None:
        variants["llama_cpp"] = partial(peer.rate, new_tokens)

    for session in sessions.values():  # warm-up
        engine_run(session, messages, 4, VIEW_ON)
    if loaded is not None:
        generate_decode_rate(loaded, exact_ids, 4)
    rates: dict[str, list[float]] = {name: [] for name in variants}
    ttft: dict[str, list[float]] = {name: [] for name in variants if name != "generate"}
    for repeat in range(repeats):
        for name in run_order(list(variants), repeat):
            variant = variants[name]
            try:
                result = variant()
            except PeerFailed as error:  # llama.cpp died: the comparison is lost, not the run
                peer_note, peer = f"failed during the run: {error}", None
                del variants[name], rates[name], ttft[name]
                continue
            rates[name].append(_rate(result))
            if isinstance(result, Finished):
                ttft[name].append(result.ttft_s)
            elif name == "llama_cpp" and peer is not None:
                ttft[name].append(peer.last_ttft_s)
    median = {name: statistics.median(values) for name, values in rates.items()}
    report: dict[str, Any] = {
        "model": any_model.info.name,
        "device": any_model.info.device,
        "dtype": any_model.info.dtype,
        "threads": torch.get_num_threads(),
        "prompt_tokens": int(ids.shape[1]),
        "new_tokens": new_tokens,
        "repeats": repeats,
        "decode_tokens_per_s": median,
        "runs": rates,
        "ttft_s": {name: statistics.median(values) for name, values in ttft.items() if values},
        # What drawing each token costs against picking the likeliest (the chat's defaults).
        "sampling_cost": 1 - median[f"{main}_sampled"] / median[main],
    }
    if loaded is not None:
        report["ratio_engine_vs_generate"] = median["engine"] / median["generate"]
        report["view_cost"] = paired_cost(rates["engine_view_on"], rates["engine"])
    if fast is not None:
        if loaded is not None:
            report["ratio_fast_vs_exact"] = median["fast"] / median["engine"]
        report["compiled_decode"] = compiled
        if "fast_eager" in median:
            if loaded is not None:
                report["ratio_fast_eager_vs_exact"] = median["fast_eager"] / median["engine"]
            report["ratio_compiled_vs_eager"] = median["fast"] / median["fast_eager"]
        report["fast_view_cost"] = paired_cost(rates["fast_view_on"], rates["fast"])
        report["prefill"] = prefill_rates(loaded, fast, repeats, peer)
        report["long_context"] = long_context_cost(fast, long_context)
    if "llama_cpp" in median:
        report["ratio_fast_vs_llama_cpp"] = median.get("fast", 0.0) / median["llama_cpp"]
    if report["ttft_s"].get("llama_cpp") and "fast" in report["ttft_s"]:
        # the chat prompt's time to first token, Glassbox's over llama.cpp's (below 1: sooner)
        report["ttft_ratio_fast_vs_llama_cpp"] = (
            report["ttft_s"]["fast"] / report["ttft_s"]["llama_cpp"]
        )
    if peer is not None:
        peer.close()
    if peer_note:
        report["llama_cpp"] = peer_note
    report["peak_rss_mb"] = peak_rss_mb()
    return report


def run_order(names: Sequence[str], repeat: int) -> list[str]:
    """The variants' order in repeat `repeat`: each (a view-off one and its view-on one as one)
    goes first in turn, and a view-on variant runs right beside its view-off one, before it
    in every other repeat.

    A fixed order times every variant in the same place of the cycle (the view on always
    right after the view off, the view off always right after the slow eager step): a
    position's bias then reads as the variants' difference."""
    groups: dict[str, list[str]] = {}
    for name in names:
        base = name.removesuffix(VIEW_ON_SUFFIX)
        if base != name and base in groups:
            groups[base].insert(0 if repeat % 2 else 1, name)
        else:
            groups[name] = [name]
    order = list(groups.values())
    turn = repeat % len(order) if order else 0
    return [name for group in order[turn:] + order[:turn] for name in group]


def paired_cost(on: Sequence[float], off: Sequence[float]) -> float:
    """1 - the median of on/off over repeats: each repeat runs the two variants one after the
    other (`run_order`), so a ratio within a repeat shares the machine's state of that moment
    (a noisy machine's drift cancels, where a ratio of separate medians keeps it)."""
    return 1 - statistics.median(a / b for a, b in zip(on, off, strict=True))


def wait_for_compiled(fast: LoadedModel) -> dict[str, Any]:
    """Wait until the fast model's compiled decode step is attached (compiled first if it is not
    kept: a few minutes, once), so that `fast` is timed as users run it; say how it went."""
    attacher = fast.compiling
    if attacher is None:
        return {"decode_step": NOT_COMPILED}
    start = time.perf_counter()
    attacher.done.wait()
    return {"decode_step": attacher.state, "waited_s": time.perf_counter() - start}


def eager_run(session: ChatSession, messages: Sequence[Message], new_tokens: int) -> Finished:
    """engine_run of the fast model with its compiled step set aside: what it replaces."""
    model = cast("GGUFLlama", session.model)
    step, model.decode_step = model.decode_step, None
    try:
        return engine_run(session, messages, new_tokens, ProbeSettings.off())
    finally:
        model.decode_step = step


def _rate(result: Finished | float) -> float:
    return result.decode_tokens_per_s if isinstance(result, Finished) else result


def prefill_rates(
    exact: LoadedModel | None, fast: LoadedModel, repeats: int, peer: LlamaCppPeer | None = None
) -> dict[str, Any]:
    """Tokens/s of one prefill of PREFILL_TOKENS tokens: fast, exact and llama.cpp (those
    present), interleaved."""
    ids = _filler(fast, PREFILL_TOKENS)
    passes: dict[str, Callable[[], float]] = {"fast": partial(_prefill_seconds, fast, ids)}
    if exact is not None:
        passes["exact"] = partial(_prefill_seconds, exact, ids)
    if peer is not None:
        passes["llama_cpp"] = lambda: PREFILL_TOKENS / peer.prefill_rate(ids[0, :-1].tolist())
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(max(repeats, 2)):
        for name, timed in list(passes.items()):
            try:
                seconds[name].append(timed())
            except PeerFailed:  # the comparison is lost, not the run
                del passes[name], seconds[name]
    rates = {name: PREFILL_TOKENS / statistics.median(s) for name, s in seconds.items()}
    report: dict[str, Any] = {"tokens": PREFILL_TOKENS, "tokens_per_s": rates}
    for other in ("exact", "llama_cpp"):
        if other in rates:
            report[f"ratio_fast_vs_{other}"] = rates["fast"] / rates[other]
    return report


def _prefill_seconds(loaded: LoadedModel, ids: torch.Tensor) -> float:
    """Seconds of one pass of PREFILL_TOKENS ids into an empty cache."""
    decoder = decoder_for(loaded.model)
    synchronize(decoder.device)
    start = time.perf_counter()
    decoder.forward(ids[:, :PREFILL_TOKENS].to(decoder.device), decoder.new_cache(), None)
    synchronize(decoder.device)
    return time.perf_counter() - start


def long_context_cost(fast: LoadedModel, context: int) -> dict[str, Any]:
    """A decode step at `context` tokens against one at ~40, and what their bytes predict.

    A step reads every weight once plus the keys and values it attends over; if nothing else
    grows with the context, t_long / t_short ≈ (weights + KV long) / (weights + KV short).
    """
    decoder = decoder_for(fast.model)
    weights = cast("GGUFLlama", fast.model).weight_bytes()  # the fast path: Glassbox's model
    ids = _filler(fast, context)
    out: dict[str, Any] = {"weight_bytes": weights}
    for name, length in (("short", 40), ("long", context)):
        cache = decoder.new_cache()
        decoder.forward(ids[:, :length], cache, None)
        token = ids[:, length : length + 1]
        decoder.forward(token, cache, None)  # warm
        times = []
        for _ in range(STEPS):
            cache.truncate(length)
            synchronize(decoder.device)
            start = time.perf_counter()
            decoder.forward(token, cache, None)
            synchronize(decoder.device)
            times.append(time.perf_counter() - start)
        out[name] = {
            "context": length,
            "step_ms": 1000 * statistics.median(times),
            "kv_bytes": sum(cache.layer_bytes()),
        }
    time_ratio = out["long"]["step_ms"] / out["short"]["step_ms"]
    bytes_ratio = (weights + out["long"]["kv_bytes"]) / (weights + out["short"]["kv_bytes"])
    out["time_ratio"] = time_ratio
    out["bytes_ratio"] = bytes_ratio
    out["cost_vs_bytes"] = time_ratio / bytes_ratio  # target: at most 1.3
    return out


def _filler(loaded: LoadedModel, tokens: int) -> torch.Tensor:
    """`tokens` ids of ordinary text (the prompt repeated), [1, tokens + 1]."""
    piece = loaded.tokenizer(PROMPT + " A step reads the weights and the cache. ")["input_ids"]
    repeated = (piece * (tokens // len(piece) + 2))[: tokens + 1]
    return torch.tensor([repeated])


def peak_rss_mb() -> float:
    """The process's peak resident memory so far (both models are loaded in a bench run)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)


def _llama_cpp(path: str, prompt: list[int]) -> tuple[LlamaCppPeer | None, str | None]:
    """llama.cpp on the same file in its own process, warmed up; or None and why not."""
    if not llama_cpp_peer.installed():
        return None, "not installed (pip install llama-cpp-python to compare)"
    peer = LlamaCppPeer(path, prompt, torch.get_num_threads())
    try:
        peer.rate(4)  # the warm-up, and the proof that it runs on this machine
    except PeerFailed as error:
        peer.close()
        return None, f"could not run here: {error}"
    return peer, None
