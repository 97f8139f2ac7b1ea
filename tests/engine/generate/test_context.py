"""Fitting conversations into the context window: drop the oldest turns, or stop."""

from __future__ import annotations

import pytest

from engine.generate.context import ContextFull, fit
from engine.settings import Message


def words(messages):  # one token per word, so the arithmetic is visible
    return [0] * sum(len(m.content.split()) for m in messages)


SYSTEM = Message("system", "be brief")  # 2 tokens
TURNS = [
    Message("user", "one two three"),
    Message("assistant", "four five"),
    Message("user", "six seven eight"),
    Message("assistant", "nine"),
    Message("user", "ten eleven"),
]


def test_a_conversation_that_fits_is_untouched():
    fitted = fit([SYSTEM, *TURNS], words, max_context=100, reserve=10)
    assert fitted.messages == (SYSTEM, *TURNS) and fitted.dropped == 0
    assert fitted.prompt_tokens == 13


def test_oldest_turns_are_dropped_whole_and_the_system_prompt_stays():
    fitted = fit([SYSTEM, *TURNS], words, max_context=11, reserve=4)  # budget 7
    assert fitted.messages == (SYSTEM, TURNS[4])
    assert fitted.dropped == 4 and fitted.prompt_tokens == 4


def test_stop_policy_refuses_with_the_numbers():
    with pytest.raises(ContextFull, match="needs 13 tokens plus 4"):
        fit([SYSTEM, *TURNS], words, max_context=12, reserve=4, policy="stop")


def test_a_single_message_too_long_is_refused_even_when_dropping():
    with pytest.raises(ContextFull, match="alone needs"):
        fit([SYSTEM, Message("user", "w " * 50)], words, max_context=20, reserve=4)


def test_unknown_context_size_never_drops():
    fitted = fit(TURNS, words, max_context=0, reserve=4)
    assert fitted.messages == tuple(TURNS)


def test_turns_are_dropped_with_few_encodings():
    calls = []

    def counting(messages):
        calls.append(len(messages))
        return words(messages)

    long = [Message("user", "a b c"), Message("assistant", "d e")] * 200 + [TURNS[-1]]
    fitted = fit([SYSTEM, *long], counting, max_context=40, reserve=4)  # budget 36
    # 2 + 6 turns x 5 + 2 = 34 tokens fit; a seventh turn would make 39.
    assert fitted.messages == (SYSTEM, *long[-13:]) and fitted.prompt_tokens == 34
    assert len(words([SYSTEM, *long[-15:]])) > 36
    assert fitted.dropped == 388 and len(calls) < 15
