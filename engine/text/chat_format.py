"""Which chat template a model's prompts are rendered with, and the tokens that end its turn.

A model's own chat template always wins. A GGUF that carries none (a Gemma-3 Q4_K_M seen in the
wild has no `tokenizer.chat_template`) gets the template its architecture was trained on,
written out here, where the special tokens that template needs are in the vocabulary:

    gemma, gemma2, gemma3   <start_of_turn>user ... <end_of_turn>, the reply's role is `model`
    qwen2, qwen3            ChatML: <|im_start|>role ... <|im_end|>
    llama                   Llama 3 headers (<|start_header_id|> ... <|eot_id|>), else ChatML

Anything else keeps the plain `user:`/`assistant:` transcript of engine/text/prompt.py, whose reply
stops where the model starts a new `user:` or `assistant:` line (PLAIN_STOP_STRINGS).

A reply ends at the end-of-turn token of the template in use (END_OF_TURN, where the template
names it and the vocabulary holds it) as well as at the model's EOS: `end_of_turn_ids`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

log = logging.getLogger(__name__)

OWN = "own"  # the model's own template
PLAIN = "plain"  # no template: the plain transcript

# End-of-turn tokens of the templates Glassbox knows (its own below, and common model ones).
END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")

# The plain transcript's reply ends where the model starts writing the user's next turn.
# A new line of either role ends the reply: a base model that goes on to write the user's turn,
# or another turn of its own (the Gemma-3-270M base file repeats "assistant: ..." lines).
PLAIN_STOP_STRINGS = ("\nuser:", "\nassistant:")

# Gemma's own template (as Gemma 3 ships it, for string contents): the system prompt is folded
# into the first user turn, the assistant's role is called `model`.
GEMMA = r"""{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
    {{- message['content'] | trim }}
    {{- '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""

CHATML = r"""{%- for message in messages -%}
    {{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|im_start|>assistant\n' }}
{%- endif -%}"""

LLAMA3 = r"""{{ bos_token }}
{%- for message in messages -%}
    {{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}
    {{- message['content'] | trim }}
    {{- '<|eot_id|>' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif -%}"""


@dataclass(frozen=True, slots=True)
class Template:
    name: str
    source: str  # Jinja, rendered as transformers renders chat templates
    needs: tuple[str, ...]  # special tokens the vocabulary must hold


TEMPLATES = {
    "gemma": Template("gemma", GEMMA, ("<start_of_turn>", "<end_of_turn>")),
    "chatml": Template("chatml", CHATML, ("<|im_start|>", "<|im_end|>")),
    "llama3": Template(
        "llama3", LLAMA3, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    ),
}

# Per architecture (GGUF `general.architecture`, or transformers' model_type), the templates
# to try in order: the first whose tokens are all in the vocabulary is used.
BY_ARCHITECTURE = {
    "gemma": ("gemma",),
    "gemma2": ("gemma",),
    "gemma3": ("gemma",),
    "qwen2": ("chatml",),
    "qwen3": ("chatml",),
    "llama": ("llama3", "chatml"),
}

# How the window and the terminal name the template in use.
LABELS = {
    OWN: "the model's own chat template",
    PLAIN: "no chat template: a plain user:/assistant: transcript",
    "gemma": "Gemma's chat template (the file has none; chosen by architecture)",
    "chatml": "ChatML (the file has none; chosen by architecture)",
    "llama3": "the Llama 3 chat template (the file has none; chosen by architecture)",
}
FORCED = "the {} chat template (--chat-template)"


class Vocabulary(Protocol):
    """The tokenizer methods used here (transformers' tokenizer and LeanTokenizer have them)."""

    chat_template: Any

    def convert_tokens_to_ids(self, token: str, /) -> Any: ...

    def decode(self, ids: list[int], /, skip_special_tokens: bool = ...) -> Any: ...


def normalise(architecture: str) -> str:
    """`gemma3_text` (transformers' text-only Gemma 3) is `gemma3`; names are lower-case."""
    return architecture.lower().removesuffix("_text")


def choose(architecture: str, has_token: Callable[[str], bool]) -> Template | None:
    """The known template for `architecture` whose special tokens are all present, if any."""
    for name in BY_ARCHITECTURE.get(normalise(architecture), ()):
        template = TEMPLATES[name]
        if all(has_token(token) for token in template.needs):
            return template
    return None


def apply(tokenizer: Vocabulary, architecture: str, choice: str = "auto") -> str:
    """Give a tokenizer without a chat template its architecture's known one; return the name
    of the template in use: OWN, one of TEMPLATES, or PLAIN.

    `choice` other than "auto" overrides: PLAIN drops any template (a base model may continue
    a transcript better than turns it was never trained on), a name in TEMPLATES sets that one
    (ValueError if the vocabulary lacks its tokens).
    """
    if choice == PLAIN:
        tokenizer.chat_template = None
        return PLAIN
    if choice != "auto":
        forced = TEMPLATES[choice]
        missing = [t for t in forced.needs if token_id(tokenizer, t) is None]
        if missing:
            raise ValueError(
                f"the {choice} chat template needs {', '.join(missing)}, not in this vocabulary"
            )
        tokenizer.chat_template = forced.source
        return choice
    if tokenizer.chat_template:
        return OWN
    template = choose(architecture, lambda token: token_id(tokenizer, token) is not None)
    if template is None:
        return PLAIN
    tokenizer.chat_template = template.source
    return template.name


def label(name: str, forced: bool = False) -> str:
    """The template in words; `forced`: chosen by the user rather than found or guessed."""
    if forced and name in TEMPLATES:
        return FORCED.format(name)
    if forced and name == PLAIN:
        return LABELS[PLAIN] + " (--chat-template plain)"
    return LABELS.get(name, name)


def token_id(tokenizer: Vocabulary, token: str) -> int | None:
    """The id of `token` if the vocabulary holds it as one token (transformers maps an unknown
    token to the unknown token's id, so the id is checked to decode back to the token)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int) or found < 0:
        return None
    return found if tokenizer.decode([found], skip_special_tokens=False) == token else None


def end_of_turn_ids(tokenizer: Vocabulary) -> frozenset[int]:
    """The ids of the end-of-turn tokens the tokenizer's chat template writes (none without a
    template): a reply stops there as at the EOS."""
    template = tokenizer.chat_template
    if not isinstance(template, str):
        return frozenset()
    ids = (token_id(tokenizer, token) for token in END_OF_TURN if token in template)
    return frozenset(i for i in ids if i is not None)
