"""A made-up tokenizer of a given vocabulary size, written as GGUF tokenizer metadata.

A random-weight model needs a tokenizer that both transformers' GGUF converter and the fast
engine load, with the vocabulary size of the model it stands for and its special tokens at
their ids (the chat template's turn markers, BOS/EOS/pad). The real vocabularies are megabytes
of metadata a GPU machine without network does not have; this one is built from nothing:

- byte-level BPE ("gpt2", SmolLM2's and Qwen's kind): the 256 byte symbols, merges of a space
  or a lowercase letter with a lowercase letter, then unreachable filler tokens;
- sentencepiece ("llama", Gemma's kind, with scores and byte-fallback tokens <0x00>..<0xFF>):
  "▁", letters and their pairs, then fillers.

Text tokenises into letter pairs: fewer tokens than bytes, more than a real vocabulary gives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from string import ascii_lowercase
from typing import Any

from tokenizers.pre_tokenizers import ByteLevel

NORMAL, CONTROL, BYTE = 1, 3, 6  # llama.cpp's token types
SPACE_BPE, SPACE_SP = "\u0120", "\u2581"  # how each kind spells a leading space


@dataclass(frozen=True)
class TokenizerShape:
    """What of a real file's tokenizer the stand-in keeps."""

    model: str  # tokenizer.ggml.model: "gpt2" or "llama"
    pre: str  # tokenizer.ggml.pre
    special: dict[int, str]  # control tokens at their ids
    ids: dict[str, int]  # bos / eos / padding / unknown token ids
    flags: dict[str, bool] = field(default_factory=dict)  # add_bos_token, add_space_prefix...
    byte_tokens_at: int = 0  # sentencepiece: the id of <0x00>


def metadata(shape: TokenizerShape, vocab: int) -> dict[str, Any]:
    """The tokenizer.ggml.* keys of a stand-in with `vocab` tokens."""
    tokens, types = _vocabulary(shape, vocab)
    keys: dict[str, Any] = {
        "tokenizer.ggml.model": shape.model,
        "tokenizer.ggml.pre": shape.pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
    }
    if shape.model == "gpt2":
        keys["tokenizer.ggml.merges"] = [f"{a} {b}" for a, b in _pairs(SPACE_BPE)]
    else:  # sentencepiece: likelier tokens score higher, control and byte tokens lowest
        keys["tokenizer.ggml.scores"] = [
            -float(index) if kind == NORMAL else -1000.0 for index, kind in enumerate(types)
        ]
    for name, token_id in shape.ids.items():
        keys[f"tokenizer.ggml.{name}_token_id"] = token_id
    for name, value in shape.flags.items():
        keys[f"tokenizer.ggml.{name}"] = value
    return keys


def _pairs(space: str) -> list[tuple[str, str]]:
    """The merges: a space or a letter, then a letter ("▁a", "ab"...)."""
    return [(first, second) for first in (space, *ascii_lowercase) for second in ascii_lowercase]


def _vocabulary(shape: TokenizerShape, vocab: int) -> tuple[list[str], list[int]]:
    tokens: list[str | None] = [None] * vocab
    types = [NORMAL] * vocab
    for token_id, token in shape.special.items():
        tokens[token_id], types[token_id] = token, CONTROL
    if shape.model == "gpt2":
        ordinary = [*_byte_alphabet(), *(a + b for a, b in _pairs(SPACE_BPE))]
    else:
        for byte in range(256):
            at = shape.byte_tokens_at + byte
            tokens[at], types[at] = f"<0x{byte:02X}>", BYTE
        ordinary = [SPACE_SP, *ascii_lowercase, *(a + b for a, b in _pairs(SPACE_SP))]
    free = (index for index, token in enumerate(tokens) if token is None)
    for token, index in zip(ordinary, free, strict=False):
        tokens[index] = token
    filled = [
        token if token is not None else f"<filler{index}>" for index, token in enumerate(tokens)
    ]
    return filled, types


def _byte_alphabet() -> list[str]:
    """The 256 printable stand-ins for bytes of byte-level BPE."""
    return sorted(ByteLevel.alphabet())
