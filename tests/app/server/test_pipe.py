"""The pipe's wire format: events come back equal and read-only, small arrays inside the pickle
frame, every event class pickled by its fields."""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
import struct

import numpy as np

from app.server import wire
from app.server.pipe import (
    INLINE_BYTES,
    encode,
    send_message,
    wire_reducers,
)
from engine import events
from engine.events import Candidate, Roofline, Token, Transfer, frozen_array
from tests.app.server.test_shared_arrays import cross as through_the_pipe


def token(index: int, rng: np.random.Generator) -> Token:
    return Token(
        index=index,
        token_id=1000 + index,
        text=" word",
        piece=" word",
        seconds=0.012,
        kv_bytes=1_234_567,
        kv_bytes_per_layer=(41_000,) * 30,
        attention={29: frozen_array(rng.random((9, 500), dtype=np.float32))},
        top_k=tuple(Candidate(j, f" w{j}", 0.1 / (j + 1), 0.05) for j in range(10)),
        roofline=Roofline(1e8, 2e8, 0.5, 1e10, 2e10, "memory"),
        label="",
        transfer=Transfer(4096, 0.001, 0.002, 0.01),
        head_stats={layer: frozen_array(rng.random((2, 9), dtype=np.float32)) for layer in (0, 9)},
    )


def cross(message):
    """`message` through a pipe as the engine sends it, without shared memory."""
    back, _ = through_the_pipe(message, None)
    return back


def assert_same_token(back: Token, sent: Token) -> None:
    for field in dataclasses.fields(Token):
        mine, theirs = getattr(back, field.name), getattr(sent, field.name)
        if isinstance(theirs, dict):
            assert mine.keys() == theirs.keys(), field.name
            for layer, array in theirs.items():
                np.testing.assert_array_equal(mine[layer], array)
                assert mine[layer].dtype == array.dtype
                assert not mine[layer].flags.writeable
        else:
            assert mine == theirs, field.name


def test_tokens_cross_equal_with_read_only_arrays():
    rng = np.random.default_rng(0)
    sent = wire.Events(7, tuple(token(i, rng) for i in range(3)), 1.5)
    back = cross(sent)
    assert (back.job, back.queued_at, len(back.events)) == (7, 1.5, 3)
    for mine, theirs in zip(back.events, sent.events, strict=True):
        assert type(mine) is Token
        assert_same_token(mine, theirs)


def test_small_read_only_arrays_travel_inside_the_pickle_and_rows_out_of_band():
    rng = np.random.default_rng(1)
    message = wire.Events(1, (token(1, rng),), 0.0)
    reader, writer = multiprocessing.Pipe(duplex=False)
    try:
        send_message(writer, message)
        first = reader.recv_bytes()
        (count,) = struct.unpack_from("!I", first)
        frames = [reader.recv_bytes() for _ in range(count)]
    finally:
        reader.close()
        writer.close()
    # The head statistics (72 bytes each) are in the pickle; the 18 KB rows follow alone.
    assert count == 1
    assert len(frames[0]) == 9 * 500 * 4 >= INLINE_BYTES


def test_a_writable_array_still_comes_back_read_only():
    values = np.arange(6, dtype=np.float32)  # not frozen: it travels as a frame of its own
    back = cross(wire.Events(1, (events.StepRows(2, {0: values}),), 0.0))
    np.testing.assert_array_equal(back.events[0].attention[0], values)
    assert not back.events[0].attention[0].flags.writeable


def test_the_events_that_cross_are_pickled_by_their_fields():
    crossing = (
        events.Token, events.Candidate, events.Roofline, events.Transfer, events.PrefillDone,
        events.StepRows, events.LayerLens, events.Failed, events.Finished,
    )  # fmt: skip
    reducers = wire_reducers()
    for cls in crossing:
        assert cls in reducers, cls.__name__
    candidate = Candidate(3, " a", 0.5, 0.25)
    assert reducers[Candidate](candidate) == (Candidate, (3, " a", 0.5, 0.25))


def test_a_request_encodes_as_a_plain_pickle():
    request = wire.Fetch(3, (0, 9))
    assert pickle.loads(encode(request)) == request
