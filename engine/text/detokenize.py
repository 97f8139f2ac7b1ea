"""Stream decoded text so it never shows half a character or a stop string.

Token ids are decoded incrementally (a short window of earlier tokens gives the tokenizer its
context, as vLLM does). Text is released either with each token (`per_token`: every whole
character decoded so far) or by whole words (up to the last whitespace, so a reader never sees
a broken word piece), and never the tail that could still become a stop string. Joined, the
released pieces equal the full decode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for hints: the fast path never imports transformers
    from transformers import PreTrainedTokenizerBase


CONTEXT_TOKENS = 4  # earlier ids decoded along, so a word's leading space survives
LONGEST_WORD = 32  # past this many characters without a boundary, show the text anyway


class TextStream:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        context_ids: list[int] | tuple[int, ...] = (),
        stop_strings: tuple[str, ...] = (),
        per_token: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.per_token = per_token
        self._ids = list(context_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # window start: decoded for context only
        self._read = len(self._ids)  # ids before this are already part of `text`
        self._context = len(self._ids)
        self.text = ""  # everything decoded so far (cut at a stop string once one appears)
        self.released = 0  # how much of `text` has been handed out
        self.stopped = False

    def push(self, token_id: int, last: bool = False) -> str:
        """Add a token; return the text that may be shown now (often ""). `last` flushes all."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self._ids)
        self._cut_at_stop_string()
        if last and not self.stopped:
            return self.finish()
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """The reply is over: release what is left, reconciled with one full decode."""
        if not self.stopped:
            full = self._decode(self._ids[self._context :])
            if full.startswith(self.text[: self.released]):
                self.text = full
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            limit = end - _stop_prefix_tail(self.text, self.released, self.stop_strings)
            end = limit if self.per_token else _last_boundary(self.text, self.released, limit)
            if end <= self.released and limit - self.released > LONGEST_WORD:
                end = limit  # a run without spaces (code, a URL, a degenerate reply)
        if end <= self.released:
            return ""
        piece, self.released = self.text[self.released : end], end
        return piece

    def _cut_at_stop_string(self) -> None:
        for stop in self.stop_strings:
            at = self.text.find(stop, max(self.released - len(stop), 0))
            if at >= 0:
                self.text, self.stopped = self.text[:at], True

    def _decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )
        return text if isinstance(text, str) else "".join(text)


def _stop_prefix_tail(text: str, start: int, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of text[start:] that begins some stop string: that much
    could still become one, so it is held back (and nothing more)."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text) - start), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


def _last_boundary(text: str, start: int, limit: int) -> int:
    """End of the last whole word in text[start:limit]: after whitespace or a CJK character.

    CJK scripts write no spaces between words, so each character is a boundary there (as
    transformers' TextStreamer does); elsewhere a word is shown only once it is complete.
    """
    for at in range(min(limit, len(text)) - 1, start - 1, -1):
        if text[at].isspace() or _is_cjk(text[at]):
            return at + 1
    return start


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return (
        0x3000 <= code <= 0x9FFF  # punctuation, kana, unified ideographs
        or 0xAC00 <= code <= 0xD7AF  # Hangul syllables
        or 0xF900 <= code <= 0xFAFF
        or 0x20000 <= code <= 0x2FA1F
    )
