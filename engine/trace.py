"""Record one reply's internals as the JSON document `glassbox chat --trace PATH` writes.

The same data the panels draw: the model's shape, prompt and generated ids, the prefill's
timing and attention matrix, and per step its latency, KV bytes, attention row and top-k.
"""

from __future__ import annotations

from typing import Any

from engine.events import Event, Failed, Finished, ModelInfo, PrefillDone, Token
from engine.serialize import plain


class TraceRecorder:
    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        self.prefill: PrefillDone | None = None
        self.tokens: list[Token] = []
        self.finished: Finished | None = None
        self.error: str | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, PrefillDone):
            self.prefill, self.tokens, self.finished = event, [], None
        elif isinstance(event, Token):
            self.tokens.append(event)
        elif isinstance(event, Failed):
            self.error = event.message
        elif isinstance(event, Finished):
            self.finished = event

    def to_dict(self) -> dict[str, Any]:
        info, prefill, done = self.info, self.prefill, self.finished
        return {
            "model": {
                "name": info.name,
                "layers": info.layers,
                "heads": info.heads,
                "kv_heads": info.kv_heads,
                "head_dim": info.head_dim,
                "dtype": info.dtype,
                "device": info.device,
                "bytes_per_value": info.bytes_per_value,
                "precision": info.precision,
                "peaks": plain(info.peaks),
            },
            "prompt_token_ids": list(prefill.prompt_token_ids) if prefill else [],
            "generated_token_ids": [t.token_id for t in self.tokens],
            "prefill": _prefill(prefill) if prefill else None,
            "steps": [_step(t) for t in self.tokens],
            "finish_reason": done.reason if done else None,
            "ttft_s": done.ttft_s if done else None,
            "decode_tokens_per_s": done.decode_tokens_per_s if done else None,
            "error": self.error,
        }


def _prefill(event: PrefillDone) -> dict[str, Any]:
    return {
        "seconds": event.seconds,
        "tokenize_s": event.tokenize_s,
        "tokens": event.prompt_tokens,
        "processed_tokens": event.processed_tokens,
        "reused_tokens": event.reused_tokens,
        "kv_bytes": event.kv_bytes,
        "attention": {str(k): v.tolist() for k, v in event.attention.items()},
        "roofline": plain(event.roofline),
    }


def _step(event: Token) -> dict[str, Any]:
    return {
        "token_id": event.token_id,
        "text": event.piece,
        "seconds": event.seconds,
        "kv_bytes": event.kv_bytes,
        "kv_bytes_per_layer": list(event.kv_bytes_per_layer),
        "attention": {str(k): v.tolist() for k, v in event.attention.items()},
        "top_k": [
            {"token_id": c.token_id, "text": c.text, "prob": c.prob, "sampled_prob": c.sampled_prob}
            for c in event.top_k
        ],
        "roofline": plain(event.roofline),
    }
