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
    system = list(messages[:1]) if messages and messages[0].role == "system" else []
    rest = list(messages[len(system) :])
    cuts = turn_starts(rest)
    # Fewer messages never need more tokens, so binary-search the fewest turns to drop:
    # a handful of encodings instead of one per dropped turn.
    low, high, best = 1, len(cuts) - 1, None
    while low <= high:
        middle = (low + high) // 2
        candidate = encode([*system, *rest[cuts[middle] :]])
        if len(candidate) <= budget:
            best, high = (middle, candidate), middle - 1
        else:
            low = middle + 1
    if best is None:
        alone = len(encode([*system, *rest[cuts[-1] :]]))
        raise ContextFull(
            f"This message alone needs {alone} tokens with the system prompt, but the model"
            f" holds {max_context} (with {reserve} kept for the reply). Shorten it."
        )
    index, ids = best
    return Fitted((*system, *rest[cuts[index] :]), ids, cuts[index])


def turn_starts(messages: Sequence[Message]) -> list[int]:
    """Where the conversation may start after dropping whole turns, oldest first.

    A turn is a user message and the reply that answered it; the last message always stays.
    """
    starts, at = [0], 0
    while len(messages) - at > 1:
        at += 2 if len(messages) - at > 2 and messages[at + 1].role == "assistant" else 1
        starts.append(at)
    return starts
