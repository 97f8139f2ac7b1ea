"""Fit a conversation into the model's context window.

When the next prompt would not fit, the user's chosen policy applies: drop the oldest turns
(the system prompt stays), or stop and say so. Either way nothing is cut silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.settings import Message

Policy = Literal["drop_oldest", "stop"]


class ContextFull(Exception):
    """The prompt cannot fit; the message says by how much and what to do."""


@dataclass(frozen=True, slots=True)
class Fitted:
    messages: tuple[Message, ...]
    prompt_ids: list[int]  # the prompt the kept messages encode to
    dropped: int  # how many of the oldest messages were left out

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def fit(
    messages: Sequence[Message],
    encode: Callable[[Sequence[Message]], list[int]],
    max_context: int,
    reserve: int,
    policy: Policy = "drop_oldest",
) -> Fitted:
    """The messages to send, leaving `reserve` tokens of room for the reply."""
    budget = max_context - reserve if max_context else None
    ids = encode(messages)
    tokens = len(ids)
    if budget is None or tokens <= budget:
        return Fitted(tuple(messages), ids, 0)
    if policy == "stop":
        raise ContextFull(
            f"The conversation needs {tokens} tokens plus {reserve} for the reply, but the model"
            f" holds {max_context}. Start a new chat, shorten the message, or let Glassbox drop"
            " the oldest turns."
        )
    system = [m for m in messages[:1] if m.role == "system"]
    rest = list(messages[len(system) :])
    dropped = 0
    while len(rest) > 1 and tokens > budget:
        # Drop whole turns: a user message and the reply that answered it.
        cut = 2 if len(rest) > 2 and rest[1].role == "assistant" else 1
        rest, dropped = rest[cut:], dropped + cut
        ids = encode([*system, *rest])
        tokens = len(ids)
    if tokens > budget:
        raise ContextFull(
            f"This message alone needs {tokens} tokens with the system prompt, but the model"
            f" holds {max_context} (with {reserve} kept for the reply). Shorten it."
        )
    return Fitted((*system, *rest), ids, dropped)
