"""The engine's events as OpenAI's replies: a whole `chat.completion` / `text_completion`, or
its stream of chunks. Text is the session's streamed text (Token.text: whole characters, stop
strings cut); log-probabilities are the engine's own next-token probe (Token.top_k: the
softmax of the model's logits); usage counts come from PrefillDone and Finished, with
Glassbox's timings in `usage.timings`."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.events import Candidate, Finished, FinishReason, Token

Kind = Literal["chat", "text"]
# What a chat client learns of why a reply ended (a cancelled one has no reader left).
FINISH: dict[FinishReason, str] = {
    "eos": "stop",
    "stop_string": "stop",
    "cancelled": "stop",
    "length": "length",
    "context_full": "length",
    "error": "stop",
}
UNLIKELY = -9999.0  # OpenAI's log-probability for a token outside the top 20


@dataclass
class Reply:
    """One reply as it is built: `kind` chat or text completion, `top` how many alternatives
    each token's log-probabilities list (None: no log-probabilities)."""

    kind: Kind
    model: str
    top: int | None
    # Where the reply's text starts in the text a completion's `text_offset` counts in: the
    # prompt's, then the reply's (OpenAI's offsets include the prompt without `echo` too)
    text_start: int = 0
    id: str = field(default_factory=lambda: f"glassbox-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))
    text: list[str] = field(default_factory=list)
    tokens: list[Token] = field(default_factory=list)

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def add(self, token: Token) -> None:
        self.text.append(token.text)
        self.tokens.append(token)

    # -- a whole reply --------------------------------------------------------------------------

    def whole(self, finished: Finished) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH[finished.reason]}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": finished.text}
        else:
            choice["text"] = finished.text
        choice["logprobs"] = self._logprobs(self.tokens)
        return {**self._head(self.object), "choices": [choice], "usage": usage(finished)}

    # -- a stream -------------------------------------------------------------------------------

    def first_chunk(self) -> dict[str, Any] | None:
        """A chat stream opens with the assistant's role, as OpenAI's does."""
        if self.kind != "chat":
            return None
        return self._chunk({"role": "assistant", "content": ""}, None, None)

    def token_chunk(self, token: Token) -> dict[str, Any] | None:
        """A chunk for this token, or None while its text is held and nothing is asked of it."""
        if not token.text and self.top is None:
            return None
        return self._chunk(token.text, None, self._logprobs([token]))

    def last_chunk(self, finished: Finished) -> dict[str, Any]:
        return self._chunk("" if self.kind == "text" else {}, FINISH[finished.reason], None)

    def usage_chunk(self, finished: Finished) -> dict[str, Any]:
        """`stream_options.include_usage`: a last chunk with no choices and the usage."""
        return {**self._head(self._chunk_object), "choices": [], "usage": usage(finished)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def _chunk(
        self, delta: str | dict[str, str], finish: str | None, logprobs: dict[str, Any] | None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": logprobs}
        if self.kind == "chat":
            choice["delta"] = {"content": delta} if isinstance(delta, str) else delta
        else:
            choice["text"] = delta
        return {**self._head(self._chunk_object), "choices": [choice]}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -- log-probabilities ----------------------------------------------------------------------

    def _logprobs(self, tokens: list[Token]) -> dict[str, Any] | None:
        if self.top is None:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_entry(t) for t in tokens], "refusal": None}
        before = self.tokens[: len(self.tokens) - len(tokens)]
        offsets, at = [], self.text_start + sum(len(t.text) for t in before)
        for token in tokens:
            offsets.append(at)
            at += len(token.text)
        return {
            "tokens": [t.piece for t in tokens],
            "token_logprobs": [logprob(t) for t in tokens],
            "top_logprobs": [{c.text: _log(c.prob) for c in t.top_k[: self.top]} for t in tokens],
            "text_offset": offsets,
        }

    def _chat_entry(self, token: Token) -> dict[str, Any]:
        return {
            **_entry(token.piece, logprob(token)),
            "top_logprobs": [_entry(c.text, _log(c.prob)) for c in token.top_k[: self.top]],
        }


def logprob(token: Token) -> float:
    """The token's log-probability under the model, from the probe's candidates."""
    found: Candidate | None = next((c for c in token.top_k if c.token_id == token.token_id), None)
    return UNLIKELY if found is None else _log(found.prob)


def _entry(text: str, value: float) -> dict[str, Any]:
    return {"token": text, "bytes": list(text.encode("utf-8")), "logprob": value}


def _log(prob: float) -> float:
    return math.log(prob) if prob > 0 else UNLIKELY


def usage(finished: Finished) -> dict[str, Any]:
    """Token counts as OpenAI reports them, and the reply's measured timings."""
    return {
        "prompt_tokens": finished.prompt_tokens,
        "completion_tokens": finished.generated_tokens,
        "total_tokens": finished.prompt_tokens + finished.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": finished.reused_tokens},
        "timings": {
            "ttft_s": finished.ttft_s,
            "prefill_s": finished.prefill_s,
            "prefill_tokens_per_s": finished.prefill_tokens_per_s,
            "decode_s": finished.decode_s,
            "decode_tokens_per_s": finished.decode_tokens_per_s,
            "total_s": finished.total_s,
        },
    }
