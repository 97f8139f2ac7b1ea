"""The tokenizer of the fast path: the `tokenizers` library's Rust tokenizer and the chat
template, behind the few methods of transformers' tokenizer the engine uses.

Loading it from the cached tokenizer.json takes a fraction of a second and neither imports
transformers nor keeps the Python-side copies `PreTrainedTokenizerFast` builds (33 MB here).
The exact path keeps transformers' tokenizer; a test holds the two to the same ids and text.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer

if TYPE_CHECKING:
    from jinja2 import Template


class LeanTokenizer:
    def __init__(self, backend: Tokenizer, config: dict[str, Any], chat_template: str | None):
        self.backend = backend
        self._chat_template = chat_template
        self.bos_token = _content(config.get("bos_token"))
        self.eos_token = _content(config.get("eos_token"))
        self.pad_token = _content(config.get("pad_token"))
        self.unk_token = _content(config.get("unk_token"))
        self._template: Template | None = None  # compiled on first use

    @classmethod
    def from_folder(cls, folder: Path) -> LeanTokenizer:
        """Read what `save_pretrained` wrote: tokenizer.json, its config and chat template."""
        config_file, template_file = (
            folder / "tokenizer_config.json",
            folder / "chat_template.jinja",
        )
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = template_file.read_text() if template_file.is_file() else None
        template = template or config.get("chat_template")
        return cls(Tokenizer.from_file(str(folder / "tokenizer.json")), config, template)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @chat_template.setter
    def chat_template(self, source: str | None) -> None:
        """A template set later (engine/text/chat_format.py's, where the file has none)."""
        self._chat_template, self._template = source, None

    # -- ids -------------------------------------------------------------------------------------

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids}

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool = False,  # the engine never asks for the clean-up
    ) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.convert_tokens_to_ids(self.pad_token)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
    ) -> str | list[int]:
        """The chat template rendered as transformers renders it (same Jinja settings)."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
        return self(text, add_special_tokens=False)["input_ids"] if tokenize else text


def compact_merges(tokenizer_json: Path) -> bool:
    """Rewrite a BPE tokenizer.json's merges from pairs (["a", "b"]) to the equivalent single
    strings ("a b") that the `tokenizers` library also reads, where no token holds a space.

    Parsing 515k pairs (Gemma 3's) peaks at ~360 MB and leaves ~300 MB resident, the strings
    at ~170 and ~130: that transient was the largest part of a 270M model's peak memory.
    Returns whether the file was rewritten."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    merges = data.get("model", {}).get("merges") or []
    if not merges or not isinstance(merges[0], list):
        return False
    if any(" " in part for pair in merges for part in pair):  # "a b" would be ambiguous
        return False
    data["model"]["merges"] = [f"{first} {second}" for first, second in merges]
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return True


def _content(token: Any) -> str | None:
    """A special token as the config stores it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


def _compile(source: str) -> Template:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False,
                                                                  indent=indent)  # fmt: skip
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    return env.from_string(source)
