"""Render a conversation into prompt token ids: with the tokenizer's own chat template, or in
completion mode as the plain text it is, for the model to continue."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.settings import Message

if TYPE_CHECKING:  # only for hints: the fast path never imports transformers
    from transformers import PreTrainedTokenizerBase


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """Token ids of `messages` followed by the cue for the assistant's turn."""
    dicts = [m.as_dict() for m in messages]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
        ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
        return ids
    # A base model without a template: a plain transcript it can continue.
    text = "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"
    ids = tokenizer(text)["input_ids"]
    return ids


def encode_completion(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """Token ids of the messages' text joined as written (system prompts left out).

    No template and no role markers: the model sees exactly the text and continues it. A
    continuation and the text typed after it simply append, so the next prompt extends the
    cached one. The tokenizer's own special tokens (a BOS, where it adds one) stay.
    """
    text = "".join(m.content for m in messages if m.role != "system")
    ids: list[int] = tokenizer(text)["input_ids"]
    return ids


Encoder = Callable[["PreTrainedTokenizerBase", Sequence[Message]], list[int]]


def encoder(completion: bool) -> Encoder:
    """The encoding a generation uses: plain text in completion mode, else the chat template."""
    return encode_completion if completion else encode_chat
