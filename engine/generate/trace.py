"""Record one reply's internals as the JSON document `glassbox chat --trace PATH` writes.

The same data the panels draw: the model's shape, prompt and generated ids, the prefill's
timing and attention matrix, and per step its latency, KV bytes, attention row and top-k.
A step whose logit lens was recorded (`add_lens`) also has "lens": for each layer, first to
last, its `token_ids`, `texts` and `probs` (best first), and where the token the step chose
stood (`chosen_ranks`, 0: first; `chosen_probs`); the last layer is the step's own top-k.
"""

from __future__ import annotations

from typing import Any

from engine.events import Event, Failed, Finished, LayerLens, ModelInfo, PrefillDone, Token
from engine.serialize import plain


class TraceRecorder:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.prefill: PrefillDone | None = None
        self.tokens: list[Token] = []
        self.finished: Finished | None = None
        self.error: str | None = None
        self.lenses: dict[int, LayerLens] = {}  # by step

    def add_lens(self, lens: LayerLens | None) -> None:
        """A step's logit lens (ChatSession.layer_lens; None: not kept, nothing recorded)."""
        if lens is not None:
            self.lenses[lens.step] = lens

    def add(self, event: Event) -> None:
        if isinstance(event, PrefillDone):
            self.prefill, self.tokens, self.finished = event, [], None
            self.lenses = {}
        elif isinstance(event, Token):
            self.tokens.append(event)
        elif isinstance(event, Failed):
            self.error = event.message
        elif isinstance(event, Finished):
            self.finished = event

    def to_dict(self) -> dict[str, Any]:
        prefill, done = self.prefill, self.finished
        return {
            "model": _pick(plain(self.info), MODEL_FIELDS),
            "prompt_token_ids": list(prefill.prompt_token_ids) if prefill else [],
            "generated_token_ids": [t.token_id for t in self.tokens],
            "prefill": _prefill(prefill) if prefill else None,
            "steps": [_step(t, self.lenses.get(t.index)) for t in self.tokens],
            "finish_reason": done.reason if done else None,
            "ttft_s": done.ttft_s if done else None,
            "decode_tokens_per_s": done.decode_tokens_per_s if done else None,
            "error": self.error,
        }


# What the trace keeps of each, under the events' own names (engine.serialize writes them).
MODEL_FIELDS = ("name", "layers", "heads", "kv_heads", "head_dim", "dtype", "device",
                "bytes_per_value", "precision", "peaks")  # fmt: skip
PREFILL_FIELDS = ("seconds", "tokenize_s", "processed_tokens", "reused_tokens", "kv_bytes",
                  "attention", "roofline")  # fmt: skip
STEP_FIELDS = ("token_id", "seconds", "kv_bytes", "kv_bytes_per_layer", "attention", "top_k",
               "roofline")  # fmt: skip


def _pick(data: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {name: data[name] for name in fields}


def _prefill(event: PrefillDone) -> dict[str, Any]:
    return {"tokens": event.prompt_tokens, **_pick(plain(event), PREFILL_FIELDS)}


LENS_FIELDS = ("token_ids", "texts", "probs", "chosen_ranks", "chosen_probs")


def _step(event: Token, lens: LayerLens | None) -> dict[str, Any]:
    # "text" is the token's own piece (the event's `text` is what the stream released)
    step = {"text": event.piece, **_pick(plain(event), STEP_FIELDS)}
    if lens is not None:
        step["lens"] = _pick(plain(lens), LENS_FIELDS)
    return step
