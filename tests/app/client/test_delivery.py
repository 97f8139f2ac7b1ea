"""The delivery of engine events to the GUI thread: batches sized to the drain's budget, and a
turn of the event loop of its own beside the panels' frame."""

from __future__ import annotations

import time

import pytest

from app.client import delivery as delivery_module
from app.client.delivery import DRAIN_BUDGET_S, MIN_BATCH_EVENTS, Delivery
from engine.events import Token
from ui import turns as turns_module
from ui.turns import Turns


def _token(index: int) -> Token:
    return Token(
        index=index, token_id=index, text="x", piece="x", seconds=0.0, kv_bytes=0,
        kv_bytes_per_layer=(),
    )  # fmt: skip


class FakeClock:
    """The delivery's and the turns' perf_counter: moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(delivery_module, "perf_counter", fake)
    monkeypatch.setattr(turns_module, "perf_counter", fake)
    return fake


def test_events_that_cost_more_come_in_smaller_batches_within_the_drains_budget(qtbot, clock):
    """Each event costs the listeners 1 ms here: after a few drains have timed them, a drain
    takes no more than its budget's worth (at least MIN_BATCH_EVENTS) and every event arrives
    once, in order."""
    batches: list[list[int]] = []

    def deliver(batch):
        batches.append([event.index for event in batch])
        clock.now += 0.001 * len(batch)

    delivery = Delivery(deliver, lambda job: None)
    events = 400
    delivery.push([_token(i) for i in range(events)], wait=False)
    per_drain = []
    while delivery.pushed > sum(map(len, batches)):
        before = sum(map(len, batches))
        delivery.drain()
        per_drain.append(sum(map(len, batches)) - before)
        clock.now += 0.1  # the event loop's turns between drains
    assert [i for batch in batches for i in batch] == list(range(events))
    assert per_drain[0] > 2 * per_drain[-2]  # the first drain guessed; the later ones know
    budget_events = max(MIN_BATCH_EVENTS, round(DRAIN_BUDGET_S / 0.001))
    assert all(count <= budget_events + 1 for count in per_drain[4:-1])
    delivery.close()


def test_a_cheap_stream_is_delivered_in_one_drain(qtbot, clock):
    """Events that cost nothing measurable: the whole buffer in one drain."""
    delivered = []
    delivery = Delivery(delivered.extend, lambda job: None)
    delivery.push([_token(i) for i in range(300)], wait=False)
    delivery.drain()
    assert len(delivered) == 300
    delivery.close()


def test_a_drain_right_after_other_heavy_work_gives_way_to_the_event_loop(qtbot):
    """A drain that falls due as another piece of heavy work ends (the panels' frame) delivers
    nothing in that turn and everything at a later one; its job is reached then."""
    delivered, reached = [], []
    delivery = Delivery(delivered.extend, reached.append)
    delivery.turns = Turns()
    delivery.push([_token(i) for i in range(5)], wait=False)
    with delivery.turns.piece():
        time.sleep(turns_module.LIGHT_S * 2)  # a frame's slice
    delivery.end_at(5, job=7)  # drains now, or gives way
    if delivery.turns.just_worked():  # (a very slow machine may have let a turn pass)
        assert delivered == [] and reached == []
    qtbot.waitUntil(lambda: len(delivered) == 5 and reached == [7], timeout=5_000)
    delivery.close()


def test_light_work_does_not_make_the_next_piece_wait():
    turns = Turns()
    with turns.piece():
        pass
    assert not turns.just_worked()
    with turns.piece():
        time.sleep(turns_module.LIGHT_S * 2)
    assert turns.just_worked()
