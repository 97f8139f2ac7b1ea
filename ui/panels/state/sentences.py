"""One sentence per panel about one step, built only from the numbers the engine reported.

A teacher pauses on a step and reads it out: what the step added to the KV cache, what it read
to make its token, where a head looked, how long it took. Each function takes the measured
numbers (events, ModelInfo) and nothing else, so every figure it says can be traced back.
"""

from __future__ import annotations

import numpy as np

from engine.events import ModelInfo, Roofline
from engine.kv_formula import formula_bytes
from engine.token_labels import byte_count, quoted


def size_text(count: float) -> str:
    """Bytes in decimal units, as bandwidths are quoted: 84_000_000 -> "84 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            value = count / size
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{count:,.0f} bytes"


def seconds_text(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def kv_formula(info: ModelInfo) -> int:
    """One position's keys and values over every layer, by the model's shapes."""
    return formula_bytes(info, 1)


def kv_sentence(step: int, added: int, info: ModelInfo) -> str:
    """What decode step `step` added to the cache (`added`: the measured growth in bytes)."""
    terms = (
        f"2 × {info.layers} layers × {info.kv_heads} KV heads × {info.head_dim}"
        f" × {info.bytes_per_value} bytes"
    )
    formula = kv_formula(info)
    if added == formula:
        return f"Step {step} appended one key and one value per layer: {added:,} bytes = {terms}"
    return (
        f"Step {step} grew the cache by {added:,} bytes; one key and one value per layer"
        f" would be {terms} = {formula:,} bytes"
    )


def kv_prefill_sentence(position: int, prompt_tokens: int, processed: int, total: int) -> str:
    return (
        f"Token #{position} is in the prompt: the prefill appended the keys and values of its"
        f" {processed:,} new tokens at once; the cache held {prompt_tokens:,} tokens,"
        f" {total:,} bytes"
    )


def roofline_sentence(step: int, roofline: Roofline, info: ModelInfo) -> str:
    """What the forward pass of decode step `step` moved and how hard it computed per byte."""
    weights = info.weight_bytes + info.embedding_row_bytes  # one new position
    if info.weight_bytes and roofline.bytes > weights:
        moved = (
            f"read {size_text(weights)} of weights and moved {size_text(roofline.bytes - weights)}"
            " of KV cache"
        )
    else:
        moved = f"moved {size_text(roofline.bytes)}"
    bound = f", {roofline.bound}-bound" if info.peaks is not None else ""
    return f"Step {step} {moved} to make one token: {roofline.intensity:.1f} FLOP per byte{bound}"


def timing_sentence(step: int, seconds: float, mean_s: float | None) -> str:
    """Decode step `step`'s measured latency, against the reply's mean step."""
    rate = f", {1 / seconds:.1f} tokens a second at this pace" if seconds > 0 else ""
    mean = f" (mean step so far {seconds_text(mean_s)})" if mean_s else ""
    return f"Step {step} took {seconds_text(seconds)}{rate}{mean}"


def relation(key: int, query: int) -> str:
    """Where key `key` sits for the query at `query`, in words."""
    if key == query:
        return "itself"
    if key == query - 1:
        return "the previous token"
    if key == 0:
        return "the first token"
    return f"token #{key}, {query - key} back"


def attention_sentence(layer: int, head: int, weights: np.ndarray, query: int, label: str) -> str:
    """Where `head` of `layer` put most of its weight for the query at `query`.

    `weights` is that head's row over keys 0..query (the probe's softmax); `label` names the
    key it weighted most.
    """
    key = int(np.argmax(weights))
    share = float(weights[key])
    return (
        f"Head {head} of layer {layer} gave {share:.0%} of its weight to"
        f" {relation(key, query)} '{label}'"
    )


def strongest_head(row: np.ndarray) -> int:
    """The head of a [heads, keys] row that is most decided (the highest single weight)."""
    return int(np.argmax(row.max(axis=1)))


def token_text(token_id: int, label: str) -> str:
    """A token as a sentence names it: "token 1,234 ' the'", or its bytes where it has them."""
    count = byte_count(label)
    if count:
        plural = "byte" if count == 1 else "bytes"
        return f"token {token_id:,} {label} ({count} {plural} of a character split across tokens)"
    return f"token {token_id:,} {quoted(label)}"


def reply_token_sentence(
    step: int, token_id: int, label: str, prompt_tokens: int, reused: int
) -> str:
    """What decode step `step` produced, after how much of a prompt."""
    return (
        f"Step {step} produced {token_text(token_id, label)} after {prompt_tokens:,} prompt"
        f" tokens, {reused:,} reused"
    )


def prompt_token_sentence(
    position: int, token_id: int, label: str, special: bool, prompt_tokens: int, reused: int
) -> str:
    """A prompt token: its id, whether the chat template put it there, how the prefill took it."""
    kind = ", a special token of the chat template," if special else ""
    how = "reused from the cache" if position < reused else "processed by the prefill"
    return (
        f"Prompt token #{position} is {token_text(token_id, label)}{kind} {how}"
        f" ({prompt_tokens:,} prompt tokens, {reused:,} reused)"
    )
