"""The static step's buckets recorded in the background (engine/step/bucket_recorder.py and
StaticDecode's plan): a reply never waits for a recording, its tokens are the eager step's,
a ready bucket is replayed, the recording puts back what it wrote, and closing leaves nothing
running. On the CPU a slow injected recording stands in for a CUDA graph's."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from engine.step.bucket_recorder import BucketRecorder
from engine.step.static import EAGER, StaticDecode, StepOut
from tests.engine.step.test_static import FIRST, build, greedy, tiny_gguf  # noqa: F401

WAIT_S = 60  # the longest a condition may take on a loaded machine


def until(condition, timeout: float = WAIT_S) -> None:
    """Wait for `condition()` to hold (polled), failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.005)


class SlowRecording:
    """A recording that runs the step on its warm-up inputs (as a capture's warm-up does) and
    then waits for `release` before it returns; its replays count themselves."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.replays = 0
        self.started: list[int] = []
        self.warm: list = []

    def __call__(self, step, inputs, warm):
        self.started.append(inputs[2][0].shape[2])  # the bucket's capacity
        self.warm.append(warm)
        step(*warm)
        assert self.release.wait(WAIT_S)

        def replay() -> StepOut:
            self.replays += 1
            return step(*inputs)

        return replay


def recorded(model, record, ahead: int = FIRST) -> StaticDecode:
    step = StaticDecode(model, EAGER, "test", first=FIRST, record=record, ahead=ahead)
    model.static_step = step
    return step


@pytest.fixture
def model(tiny_gguf):  # noqa: F811
    model = build(tiny_gguf)
    yield model
    if model.static_step is not None:
        assert model.static_step.close(timeout=WAIT_S)


def test_a_reply_across_buckets_never_waits_for_a_recording(model):
    layers = frozenset({0, 1})
    eager = greedy(model, layers)
    record = SlowRecording()
    step = recorded(model, record)
    fast = greedy(model, layers)  # 5 + 44 positions: buckets 16, 32 and 64
    assert record.started == [16]  # still recording the first bucket: every step uncaptured
    assert step.recorder.buckets == [] and record.replays == 0
    assert fast[0] == eager[0]
    for got, want in zip(fast[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    for got, want in zip(fast[2], eager[2], strict=True):
        assert got.keys() == want.keys() == layers
        for layer in layers:
            torch.testing.assert_close(got[layer], want[layer], atol=0, rtol=0)
    record.release.set()
    assert step.recorder.idle(WAIT_S)
    assert step.recorder.buckets == [16, 32, 64, 128, 256] == sorted(record.started)
    assert step.builds == 5  # each bucket once: planned up to 4x the context (4 * 49 -> 256)


def test_ready_buckets_are_replayed_and_say_so_in_the_log(model, caplog):
    eager = greedy(model, frozenset())
    record = SlowRecording()
    record.release.set()
    step = recorded(model, record, ahead=64)
    with caplog.at_level(logging.INFO, logger="engine.step.bucket_recorder"):
        model.new_cache()  # a load plans the first buckets: 16, 32, 64
        assert step.recorder.idle(WAIT_S)
    assert "ready: 16, 32, 64" in caplog.text
    fast = greedy(model, frozenset())
    assert fast[0] == eager[0]
    assert record.replays == len(fast[0])  # every step replayed, none uncaptured
    for got, want in zip(fast[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert step.recorder.idle(WAIT_S) and step.builds == 5  # 128 and 256: 4 * 49 ahead


def test_a_recording_never_writes_the_bucket_a_reply_may_be_using(model):
    record = SlowRecording()
    record.release.set()
    step = recorded(model, record)
    cache = model.new_cache()
    model.forward(torch.arange(3, 3 + FIRST)[None], cache, None)  # bucket 16, every slot
    assert step.recorder.idle(WAIT_S)
    before = [t.clone() for t in (*cache.keys, *cache.values)]
    step._build(16)  # recorded again, over the bucket in use: its warm-up ran the step
    keys = record.warm[-1][2]
    assert keys[0].shape == cache.keys[0].shape and keys[0].data_ptr() != cache.keys[0].data_ptr()
    assert any(k.any() for k in keys)  # the warm-up wrote its own twins
    for tensor, want in zip((*cache.keys, *cache.values), before, strict=True):
        assert torch.equal(tensor, want)


def test_closing_drops_the_queued_buckets_and_ends_the_thread(model):
    record = SlowRecording()
    step = recorded(model, record, ahead=64)
    step.plan(0)
    until(lambda: step.recorder.recording(16))
    record.release.set()
    assert step.close(timeout=WAIT_S)
    assert record.started == [16]  # 32 and 64 were dropped
    assert not any(t.name == "static-decode-recorder" for t in threading.enumerate())
    step.plan(1000)  # after close nothing more starts
    assert step.recorder.buckets == [16] and record.started == [16]


def test_one_recording_at_a_time_smallest_first_and_a_failure_spares_the_rest():
    running, most, order = [0], [0], []
    lock = threading.Lock()

    def record(capacity: int) -> str:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
            order.append(capacity)
        time.sleep(0.01)  # overlap, were two to run at once
        with lock:
            running[0] -= 1
        if capacity == 512:
            raise RuntimeError("no graph")
        return f"step {capacity}"

    recorder: BucketRecorder[str] = BucketRecorder(record)
    recorder.request([1024, 256, 512])
    recorder.request([256, 2048])  # 256 already queued or recorded: once only
    assert recorder.idle(WAIT_S)
    assert most[0] == 1 and order == [256, 512, 1024, 2048]
    assert recorder.buckets == [256, 1024, 2048]
    assert recorder.ready(1024) == "step 1024" and recorder.ready(512) is None
    assert recorder.failed == {512: "RuntimeError: no graph"}
    assert recorder.close(WAIT_S)


def test_the_status_waits_for_the_buckets_asked_for_and_says_which_are_ready(model):
    from engine.step.static import StepState

    record = SlowRecording()
    step = recorded(model, record, ahead=32)
    state = StepState(step)
    step.plan(0)  # 16 and 32
    until(lambda: step.recorder.recording(16))
    assert state.recorded(timeout=0.01) == ([], False)  # held back: not within the timeout
    record.release.set()
    assert state.recorded(timeout=WAIT_S) == ([16, 32], True)
    assert state.close(timeout=WAIT_S)


def test_a_bucket_a_reply_is_already_in_is_recorded_before_the_smaller_ones():
    release, order = threading.Event(), []

    def record(capacity: int) -> int:
        order.append(capacity)
        assert release.wait(WAIT_S)
        return capacity

    recorder: BucketRecorder[int] = BucketRecorder(record)
    recorder.request([256, 512, 1024, 2048])
    until(lambda: recorder.recording(256))
    recorder.request([1024], urgent=True)  # a long prompt went straight into 1024
    release.set()
    assert recorder.idle(WAIT_S)
    assert order == [256, 1024, 512, 2048]
    assert recorder.close(WAIT_S)
