"""How a token is shown on a chip: its text, or its bytes where they are not whole characters.

A byte-level BPE (SmolLM2's, GPT-2's) splits a character such as "’" into tokens that each
hold some of its UTF-8 bytes; decoded alone they read "\ufffd". Such a token is labelled with
its bytes instead, as a SentencePiece byte-fallback vocabulary names them: "<0xE2><0x80>".
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from typing import Any

REPLACEMENT = "\ufffd"
RIGHT_TO_LEFT = frozenset({"R", "AL"})  # Unicode bidirectional classes of Hebrew, Arabic...
_BYTE_TOKEN = re.compile(r"^(<0x[0-9A-Fa-f]{2}>)+$")


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet read backwards: the printable character standing for each
    byte (transformers' bytes_to_unicode, rebuilt so that the fast path never imports it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    shifted = 0
    characters = {}
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + shifted)] = byte
            shifted += 1
    return characters


def byte_label(data: bytes) -> str:
    return "".join(f"<0x{byte:02X}>" for byte in data)


def byte_count(label: str) -> int:
    """How many bytes a byte label ("<0xE2><0x80>") names; 0 for a token's text."""
    return label.count("<0x") if _BYTE_TOKEN.match(label) else 0


def token_string(tokenizer: Any, token_id: int) -> str | None:
    """The vocabulary's own string for a token (transformers' or the lean tokenizer's)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is not None:
        found = convert(token_id)
        return found if isinstance(found, str) else None
    backend = getattr(tokenizer, "backend", None)
    return backend.id_to_token(token_id) if backend is not None else None


def label(tokenizer: Any, token_id: int, piece: str) -> str:
    """`piece` (the token decoded alone) where it is whole characters, else the token's bytes;
    "" when it is whole characters, so an event carries nothing extra for most tokens."""
    if REPLACEMENT not in piece:
        return ""
    raw = token_string(tokenizer, token_id)
    if raw is None:
        return piece
    if _BYTE_TOKEN.match(raw):
        return raw.upper().replace("0X", "0x")
    decoder = byte_decoder()
    if all(character in decoder for character in raw):
        return byte_label(bytes(decoder[character] for character in raw))
    return piece


def special_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the tokenizer's special tokens: BOS, EOS, the chat template's markers."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(i for i, token in added.items() if getattr(token, "special", False))
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        decoder = backend.get_added_tokens_decoder()
        ids.update(i for i, token in decoder.items() if getattr(token, "special", False))
    return frozenset(ids)


def quoted(text: str) -> str:
    """A token's text as repr quotes it; one with right-to-left letters (Hebrew, Arabic) is
    isolated inside its quotes (U+2068 ... U+2069), so that it reads in its own direction
    without pulling the closing quote and the probability after it into its run, which
    showed the percentage before the token and the quotes out of place."""
    shown = repr(text)
    if not any(unicodedata.bidirectional(c) in RIGHT_TO_LEFT for c in text):
        return shown
    return f"{shown[0]}\u2068{shown[1:-1]}\u2069{shown[-1]}"
