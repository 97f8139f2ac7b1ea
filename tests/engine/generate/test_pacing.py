"""The pace of a reply (engine/generate/pacing.py): held after the prefill, one step per Next token,
slowed to a rate, resumed or stopped from another thread; the tokens and the timings are an
unpaused reply's, and the time held is in no figure."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import replace

import pytest

from engine.events import Finished, PrefillDone, Token
from engine.generate.pacing import Pacer
from engine.generate.session import ChatSession
from engine.settings import GenerationSettings, Message
from tests.models import make_tiny

QUESTION = [Message("user", "Why is the sky blue?")]
GREEDY = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True)
STEPPED = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True,
                             pause_after_prefill=True)  # fmt: skip
PATIENCE = 60.0  # seconds a condition may take on a loaded machine


def until(condition, timeout: float = PATIENCE) -> None:
    """Wait for a condition (another thread's progress), failing after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


class Reply:
    """A generation running in a thread of its own, its events collected as they come."""

    def __init__(self, session: ChatSession, settings: GenerationSettings) -> None:
        self.events: list = []
        self.arrivals: list[float] = []
        self.thread = threading.Thread(target=self._run, args=(session, settings), daemon=True)
        self.thread.start()

    def _run(self, session: ChatSession, settings: GenerationSettings) -> None:
        self.begun = time.perf_counter()
        for event in session.generate(QUESTION, settings):
            self.arrivals.append(time.perf_counter())
            self.events.append(event)

    def tokens(self) -> list[Token]:
        return [e for e in self.events if isinstance(e, Token)]

    def finished(self) -> Finished:
        self.thread.join(PATIENCE)
        assert not self.thread.is_alive()
        last = self.events[-1]
        assert isinstance(last, Finished)
        return last


@pytest.fixture(scope="module")
def session(tokenizer):
    return ChatSession(make_tiny(tokenizer, "llama"))


def test_a_paused_reply_waits_after_its_prefill_and_steps_one_token_at_a_time(session):
    reference = Reply(session, GREEDY)
    reference.finished()
    unpaused = [t.token_id for t in reference.tokens()]

    reply = Reply(session, STEPPED)
    until(lambda: session.pacer.pace.waiting)
    assert [type(e) for e in reply.events] == [PrefillDone]  # held before token 0
    for shown in range(1, 4):
        session.pacer.step()
        until(lambda shown=shown: len(reply.tokens()) == shown and session.pacer.pace.waiting)
        assert len(reply.tokens()) == shown  # one step per press, no more
    session.pacer.resume()
    finished = reply.finished()
    assert [t.token_id for t in reply.tokens()] == unpaused
    assert finished.reason == "length" and finished.generated_tokens == 6


def test_the_time_held_is_in_no_timing(session):
    """Held for a second before token 3: that token's latency and the reply's total are the
    engine's working time alone."""
    reply = Reply(session, STEPPED)
    for _ in range(3):
        until(lambda: session.pacer.pace.waiting)
        session.pacer.step()
    until(lambda: len(reply.tokens()) == 3 and session.pacer.pace.waiting)
    threading.Event().wait(1.0)  # the hold being measured, not a wait for a condition
    session.pacer.resume()
    finished = reply.finished()
    assert reply.tokens()[3].seconds < 1.0  # the step after the hold: milliseconds, held or not
    # the reply's total is its wall time less every hold, the one second included
    assert finished.total_s <= reply.arrivals[-1] - reply.begun - 1.0


def test_stop_ends_a_held_reply(session):
    reply = Reply(session, STEPPED)
    until(lambda: session.pacer.pace.waiting)
    session.cancel()
    finished = reply.finished()
    assert finished.reason == "cancelled" and not reply.tokens()  # no step after Stop
    session.pacer.resume()


def test_play_slowly_lets_the_steps_through_at_the_rate(session):
    """The steps are let through 1/rate apart (their tokens then take what the step takes,
    so the arrivals jitter on a loaded machine; the releases do not)."""
    pacer, cancelled, releases = Pacer(), threading.Event(), []
    pacer.play(20.0)  # one step every 50 ms
    for _ in range(6):
        pacer.wait(cancelled)
        releases.append(time.perf_counter())
    assert min(b - a for a, b in itertools.pairwise(releases)) >= 0.05 - 1e-3
    reference = Reply(session, GREEDY)
    reference.finished()
    session.pacer.play(50.0)
    try:
        reply = Reply(session, GREEDY)
        assert reply.finished().generated_tokens == 6
    finally:
        session.pacer.resume()
    assert [t.token_id for t in reply.tokens()] == [t.token_id for t in reference.tokens()]


def test_a_held_reply_holds_no_cpu(session):
    reply = Reply(session, STEPPED)
    until(lambda: session.pacer.pace.waiting)
    threading.Event().wait(0.3)  # past any spinning of torch's worker threads after the prefill
    cpu = time.process_time()
    threading.Event().wait(1.0)
    assert time.process_time() - cpu < 0.2  # the whole process, while held for a second
    session.pacer.resume()
    reply.finished()


def test_the_pacers_controls():
    pacer, cancelled = Pacer(), threading.Event()
    assert pacer.wait(cancelled) < 0.5 and pacer.pace.mode == "run"  # full speed: no wait
    pacer.step()
    pacer.step()
    assert pacer.pace.granted == 2 and pacer.pace.mode == "paused"
    pacer.wait(cancelled)
    pacer.wait(cancelled)
    assert pacer.pace.granted == 0
    with pytest.raises(ValueError, match="above 0"):
        pacer.play(0)
    released = threading.Event()

    def held() -> None:
        pacer.wait(cancelled)
        released.set()

    threading.Thread(target=held, daemon=True).start()
    until(lambda: pacer.pace.waiting)
    cancelled.set()
    pacer.wake()
    assert released.wait(PATIENCE)


def test_the_pacer_tells_when_a_paused_generation_is_held_and_when_it_goes_on():
    pacer = Pacer()
    told: list[bool] = []
    pacer.on_hold = told.append
    cancelled = threading.Event()
    assert pacer.wait(cancelled) >= 0 and told == []  # full speed: never held
    pacer.play(1000.0)
    pacer.wait(cancelled)
    pacer.wait(cancelled)
    assert told == []  # a slowed step waits its interval, but is not held
    pacer.pause()
    waiter = threading.Thread(target=pacer.wait, args=(cancelled,))
    waiter.start()
    until(lambda: told == [True])
    assert pacer.pace.waiting
    pacer.step()
    waiter.join(PATIENCE)
    assert told == [True, False] and not pacer.pace.waiting
    waiter = threading.Thread(target=pacer.wait, args=(cancelled,))
    waiter.start()
    until(lambda: told == [True, False, True])
    cancelled.set()
    pacer.wake()  # Stop while held: goes on, and says so
    waiter.join(PATIENCE)
    assert told == [True, False, True, False]


def test_errands_run_in_the_generations_thread_while_it_runs_and_while_it_is_held(session):
    """Work asked of a running reply (a logit lens) runs in the generating thread, between
    steps, and at once while a teacher holds the reply; the reply's tokens are unchanged."""
    reference = Reply(session, GREEDY)
    reference.finished()
    reply = Reply(session, STEPPED)
    until(lambda: session.pacer.pace.waiting)
    ran: list[int] = []
    session.pacer.run_between_steps(lambda: ran.append(threading.get_ident()))
    until(lambda: len(ran) == 1)  # held: at once, without a step
    assert ran == [reply.thread.ident] and len(reply.tokens()) == 0
    session.pacer.step()
    until(lambda: len(reply.tokens()) == 1 and session.pacer.pace.waiting)
    session.pacer.resume()
    session.pacer.run_between_steps(lambda: ran.append(threading.get_ident()))
    reply.finished()
    session.pacer.run_errands()  # one queued after the reply's last step runs here
    assert len(ran) == 2 and ran[0] == reply.thread.ident
    assert [t.token_id for t in reply.tokens()] == [t.token_id for t in reference.tokens()]


def test_an_errand_queued_before_a_step_runs_before_it():
    pacer, order = Pacer(), []
    pacer.run_between_steps(lambda: order.append("errand"))
    pacer.wait(threading.Event())
    order.append("step")
    assert order == ["errand", "step"]


def test_an_errand_that_fails_does_not_stop_the_reply(session):
    def broken() -> None:
        raise RuntimeError("a broken errand")

    reference = Reply(session, GREEDY)
    reference.finished()
    reply = Reply(session, STEPPED)
    until(lambda: session.pacer.pace.waiting)
    session.pacer.run_between_steps(broken)
    ran: list[int] = []
    session.pacer.run_between_steps(lambda: ran.append(1))
    until(lambda: ran == [1])  # the one after it still ran
    session.pacer.resume()
    finished = reply.finished()
    assert finished.reason == "length"
    assert [t.token_id for t in reply.tokens()] == [t.token_id for t in reference.tokens()]


def test_a_stepped_token_shows_its_text_with_its_step(session):
    """At full speed the window's text comes by whole words (a word piece waits for the next
    token); a stepped token's text comes with it, as with `text_per_token`."""

    def texts(reply: Reply) -> list[str]:
        reply.finished()
        return [t.text for t in reply.tokens()][:3]

    per_token = texts(Reply(session, replace(GREEDY, text_per_token=True)))
    assert texts(Reply(session, GREEDY)) != per_token  # some piece is held by whole words
    reply = Reply(session, STEPPED)
    for shown in range(1, 4):
        until(lambda: session.pacer.pace.waiting)
        session.pacer.step()
        until(lambda shown=shown: len(reply.tokens()) == shown)
    session.pacer.resume()
    assert texts(reply) == per_token
