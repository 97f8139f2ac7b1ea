"""No full garbage collection while events stream into the window; the held one runs at idle."""

from __future__ import annotations

import gc

import pytest

from app.client import full_collections
from app.client.delivery import Delivery


@pytest.fixture
def collections_seen(monkeypatch):
    """The generations of the collections that run, and a short idle wait; from a clean start
    whatever an earlier test left streaming."""
    if full_collections._saved is not None:
        first, second, _ = gc.get_threshold()
        gc.set_threshold(first, second, full_collections._saved)
    monkeypatch.setattr(full_collections, "_saved", None)
    monkeypatch.setattr(full_collections, "_holders", set())
    monkeypatch.setattr(full_collections, "IDLE_MS", 20)
    seen: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(note)
    yield seen
    gc.callbacks.remove(note)
    assert not full_collections.held()


def test_a_streaming_delivery_holds_full_collections_and_releases_them_at_idle(
    qtbot, collections_seen
):
    before = gc.get_threshold()
    delivery = Delivery(lambda batch: None, lambda job: None)
    delivery.start()
    assert full_collections.held()
    assert gc.get_threshold()[:2] == before[:2]  # the young generations as before
    assert gc.get_threshold()[2] == full_collections.HELD_THRESHOLD
    delivery.pause()
    assert full_collections.held()  # until the GUI has been idle a while
    qtbot.waitUntil(lambda: not full_collections.held())
    assert gc.get_threshold() == before
    assert 2 in collections_seen  # the full collection that was held ran
    delivery.close()


def test_the_collection_waits_for_every_holder_and_for_a_new_stream(qtbot, collections_seen):
    first = Delivery(lambda batch: None, lambda job: None)
    second = Delivery(lambda batch: None, lambda job: None)
    first.start()
    second.start()
    first.pause()
    full_collections._collect(full_collections._streams)  # a holder still streams
    assert full_collections.held()
    second.pause()  # the last holder out: the idle wait begins
    waited_since = full_collections._streams
    second.start()  # streaming again before that wait ended: it is void
    full_collections._collect(waited_since)
    assert full_collections.held()
    second.close()  # closing releases too
    qtbot.waitUntil(lambda: not full_collections.held())
    assert 2 in collections_seen
    first.close()
