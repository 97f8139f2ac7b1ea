"""The engine server's outbox: a reply's later tokens cross a few at a time, and nothing that
starts or ends a reply waits for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from app.server.outbox import MAX_UNSENT_WEIGHT, SLOWEST_TOKEN_INTERVAL_S, Outbox
from app.server.wire import Done, Events, Reply
from engine.events import Finished, Token
from tests.waiting import wait_until

HOLD_S = 60.0  # far longer than any test: a token that waited for it never arrives in time


class Written:
    """The messages an outbox wrote, and a condition to wait for a number of them."""

    def __init__(self) -> None:
        self.messages: list[Reply] = []
        self.condition = threading.Condition()

    def write(self, reply: Reply, weight: int) -> None:
        with self.condition:
            self.messages.append(reply)
            self.condition.notify_all()

    def wait_for(self, count: int) -> list[Reply]:
        assert self.within(count, 30.0)
        return list(self.messages)

    def within(self, count: int, seconds: float) -> bool:
        """Whether `count` messages were written within `seconds`."""
        with self.condition:
            return self.condition.wait_for(lambda: len(self.messages) >= count, seconds)


def token(index: int) -> Token:
    return Token(index, 7, "a", "a", 0.01, 0, ())


def finished() -> Finished:
    return Finished("length", "aaaa", 4, 0, 4, 0.0, 0.1, 0.1, 0.1, 0.2)


def events(*items: Token | Finished) -> Events:
    return Events(1, tuple(items))


def contents(messages: list[Reply]) -> list[object]:
    """Each message's events (the time they were queued at aside), or the message itself."""
    return [message.events if isinstance(message, Events) else message for message in messages]


@pytest.fixture
def written() -> Written:
    return Written()


@pytest.fixture
def outbox(written: Written) -> Iterator[Outbox]:
    """An outbox whose reply has sent its first token (which went at once)."""
    box = Outbox(written.write, interval_s=HOLD_S)
    try:
        box.put(events(token(0)))
        assert contents(written.wait_for(1)) == [(token(0),)]  # not held: it shows at once
        yield box
    finally:
        box.close()


def test_a_replys_later_tokens_wait_for_its_end(written, outbox):
    for index in (1, 2, 3):
        outbox.put(events(token(index)))
    # They wait (a written token would be here well within the second; a loaded machine can
    # only make it later, so this cannot fail a correct outbox).
    assert not written.within(2, 1.0)
    outbox.put(events(finished()))  # the end takes the waiting tokens along
    assert contents(written.wait_for(2)[1:]) == [(token(1), token(2), token(3), finished())]


def test_later_tokens_wake_nobody_while_the_next_message_is_not_due(written, outbox):
    """After a message of a streaming reply the sending thread sleeps until the next one is
    due: the tokens that come meanwhile are taken along then, and only what may not wait (here
    the reply's end) wakes it before, once."""
    assert wait_until(lambda: outbox._pacing)  # the thread went back to sleep after token 0
    woken = outbox.wakeups
    for index in (1, 2, 3):
        outbox.put(events(token(index)))
    # Woken by them, it would be within the second; a loaded machine can only make it later.
    assert not wait_until(lambda: outbox.wakeups > woken, 1.0)
    outbox.put(events(finished()))
    assert contents(written.wait_for(2)[1:]) == [(token(1), token(2), token(3), finished())]
    assert outbox.wakeups == woken + 1


def test_after_a_replys_end_the_sending_thread_sleeps_until_something_comes(written):
    """No reply streams after its end: the thread waits for the next item, not for a message
    due a cadence later (a wake-up for nothing after every reply and every other message)."""
    box = Outbox(written.write, interval_s=0.1)
    try:
        box.put(events(token(0), finished()))
        written.wait_for(1)
        woken = box.wakeups
        # Paced, it would wake 0.1 s after the end; a loaded machine only makes that later.
        assert not wait_until(lambda: box.wakeups > woken, 1.0)
        box.put(Events(2, (token(0),)))
        assert contents(written.wait_for(2)[1:]) == [(token(0),)]
    finally:
        box.close()


def test_tokens_after_a_message_of_another_kind_go_out_when_due(written):
    """A message that ends with no token (a hold's Done) leaves the thread waiting for an
    item; a later token then wakes it, and it sleeps until the token is due, not for good."""
    box = Outbox(written.write, interval_s=0.1)
    try:
        box.put(events(token(0)))
        box.put(Done(1))
        written.wait_for(2)
        box.put(events(token(1)))
        assert contents(written.wait_for(3)[2:]) == [(token(1),)]
    finally:
        box.close()


def test_any_other_reply_sends_the_waiting_tokens_first(written, outbox):
    outbox.put(events(token(1)))
    outbox.put(Done(1))  # e.g. a hold or the job's end: in order, and at once
    assert contents(written.wait_for(3)[1:]) == [(token(1),), Done(1)]


def test_closing_sends_what_waits(written, outbox):
    outbox.put(events(token(1)))
    outbox.close()
    assert contents(written.messages[1:]) == [(token(1),)]


def test_heavy_tokens_do_not_wait_so_the_engine_never_waits_on_the_hold(written, outbox):
    outbox.put(events(token(1)), MAX_UNSENT_WEIGHT // 4)
    outbox.put(events(token(2)), MAX_UNSENT_WEIGHT // 4)  # half the most that may wait
    assert contents(written.wait_for(2)[1:2]) == [(token(1), token(2))]


def test_a_shorter_cadence_sends_the_waiting_tokens(written, outbox):
    outbox.put(events(token(1)))
    assert not written.within(2, 0.5)  # held for the next message
    outbox.set_interval(0.0)  # the client takes events in at once now
    assert contents(written.wait_for(2)[1:]) == [(token(1),)]


def test_a_client_cannot_hold_tokens_longer_than_the_slowest_cadence(outbox):
    outbox.set_interval(60.0)
    assert outbox.interval_s == SLOWEST_TOKEN_INTERVAL_S
    outbox.set_interval(-1.0)
    assert outbox.interval_s == 0.0
