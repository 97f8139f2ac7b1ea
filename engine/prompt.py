"""Render a conversation into prompt token ids with the tokenizer's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from engine.settings import Message

if TYPE_CHECKING:  # only for hints: the fast path never imports transformers
    from transformers import PreTrainedTokenizerBase


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    """Token ids of `messages` followed by the cue for the assistant's turn."""
    dicts = [m.as_dict() for m in messages]
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template(dicts, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    # A base model without a template: a plain transcript it can continue.
    text = "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant:"
    return tokenizer(text)["input_ids"]
