"""The engine client on the shipped server (over the in-memory transport): events reach the GUI
thread in order and in batches; stop, load and failures leave it usable; shutdown leaves no
thread behind."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from PySide6.QtCore import QCoreApplication, QThread

from app.bench.synthetic import BROKEN, SyntheticSession
from app.client.engine_client import EngineClient
from app.server.jobs import proposed_request
from engine.events import Failed, Finished, PrefillDone, Token
from engine.settings import GenerationSettings, LoadRequest, Message
from tests.engines import in_memory
from tests.ui.fakes import REPLY, TOO_BIG, FakeBackend, ModelLoadError, fake_info

HELLO = (Message("user", "hello"),)
SETTINGS = GenerationSettings(greedy=True)


class Recorder:
    """Collects what a worker emits, noting the thread each batch arrived on."""

    def __init__(self, worker: EngineClient) -> None:
        self.batches: list[list] = []
        self.threads: set = set()
        self.failures: list[str] = []
        self.progress: list[tuple[str, float]] = []
        worker.events.connect(self._on_batch)
        worker.load_failed.connect(self.failures.append)
        worker.load_progress.connect(lambda stage, f: self.progress.append((stage, f)))

    def _on_batch(self, batch: list) -> None:
        self.threads.add(QThread.currentThread())
        self.batches.append(batch)

    @property
    def events(self) -> list:
        return [event for batch in self.batches for event in batch]

    @property
    def finished(self) -> list[Finished]:
        return [e for e in self.events if isinstance(e, Finished)]


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def worker(qtbot, backend):
    worker = in_memory(backend.load, backend.make_session)
    yield worker
    worker.shutdown()


def load(qtbot, worker: EngineClient, spec: str = "fake-135M") -> None:
    with qtbot.waitSignal(worker.loaded, timeout=5000):
        worker.load(LoadRequest(spec=spec))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)


def reply(qtbot, worker: EngineClient, messages=HELLO) -> None:
    with qtbot.waitSignal(worker.busy_changed, timeout=5000, check_params_cb=lambda b: not b):
        assert worker.generate(messages, SETTINGS)


def test_events_arrive_in_order_batched_on_the_gui_thread(qtbot, backend, worker):
    backend.pieces = tuple(f" w{i}" for i in range(200))
    rec = Recorder(worker)
    load(qtbot, worker)
    reply(qtbot, worker)

    events = rec.events
    assert isinstance(events[0], PrefillDone)
    assert [type(e) for e in events[1:-1]] == [Token] * 200
    assert [e.index for e in events[1:-1]] == list(range(200))
    assert events[-1] == rec.finished[0]
    assert rec.finished[0].text == "".join(e.text for e in events[1:-1])
    # 202 events, produced faster than a frame: far fewer than one delivery per event.
    assert len(rec.batches) < 20
    assert rec.threads == {QCoreApplication.instance().thread()}


def test_generate_is_refused_before_a_model_and_while_busy(qtbot, backend, worker):
    assert not worker.generate(HELLO, SETTINGS)  # nothing loaded yet
    backend.gate = threading.Semaphore(0)
    load(qtbot, worker)
    rec = Recorder(worker)
    assert worker.generate(HELLO, SETTINGS)
    assert worker.busy and worker.generating
    assert not worker.generate(HELLO, SETTINGS)
    for _ in backend.pieces:
        backend.gate.release()
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert len(backend.session.calls) == 1
    assert [f.reason for f in rec.finished] == ["eos"]


def test_stop_mid_reply_ends_it_cancelled_with_the_text_so_far(qtbot, backend, worker):
    backend.gate = threading.Semaphore(0)
    load(qtbot, worker)
    rec = Recorder(worker)
    assert worker.generate(HELLO, SETTINGS)
    backend.gate.release(2)
    qtbot.waitUntil(lambda: sum(isinstance(e, Token) for e in rec.events) == 2, timeout=5000)

    started = time.perf_counter()
    worker.stop()
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert time.perf_counter() - started < 2
    assert rec.finished[0].reason == "cancelled"
    assert rec.finished[0].text == "".join(backend.pieces[:2])


def test_stop_before_the_reply_starts_still_cancels_it(qtbot, backend, worker):
    backend.gate = threading.Semaphore(0)  # never released: only the stop can end it
    load(qtbot, worker)
    rec = Recorder(worker)
    assert worker.generate(HELLO, SETTINGS)
    worker.stop()  # most likely before the thread even picked the job up
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert [f.reason for f in rec.finished] == ["cancelled"]
    assert rec.finished[0].text == ""


def test_an_exception_in_the_session_becomes_failed_and_the_worker_survives(qtbot, backend, worker):
    load(qtbot, worker)
    backend.session.raise_after = 3
    rec = Recorder(worker)
    reply(qtbot, worker)
    failed = [e for e in rec.events if isinstance(e, Failed)]
    assert len(failed) == 1 and BROKEN in failed[0].message
    assert failed[0].error_type == "RuntimeError"
    assert isinstance(rec.events[-1], Finished)
    assert rec.events[-1].reason == "error"
    assert rec.events[-1].text == "".join(backend.pieces[:3])

    backend.session.raise_after = None
    reply(qtbot, worker)
    assert rec.finished[-1].reason == "eos"


def test_a_generator_that_ends_without_finished_still_ends_the_reply(qtbot, backend):
    class Truncated(SyntheticSession):
        def generate(self, messages, settings=None, probes=None):
            yield from list(super().generate(messages, settings, probes))[:-1]

    # A session that breaks the contract.
    worker = in_memory(backend.load, lambda loaded: Truncated(fake_info(), REPLY))
    try:
        load(qtbot, worker)
        rec = Recorder(worker)
        reply(qtbot, worker)
        assert isinstance(rec.events[-2], Failed)
        assert rec.events[-1].reason == "error"
    finally:
        worker.shutdown()


def test_a_failed_load_keeps_the_previous_model(qtbot, backend, worker):
    rec = Recorder(worker)
    load(qtbot, worker, "first")
    first = backend.session
    with qtbot.waitSignal(worker.load_failed, timeout=5000):
        worker.load(LoadRequest(spec="broken"))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)

    assert rec.failures == ["No model at broken: that file or folder does not exist."]
    assert worker.info.name == "first"
    reply(qtbot, worker)
    assert len(first.calls) == 1
    assert rec.finished[-1].reason == "eos"
    assert ("Ready", 1.0) in rec.progress


def test_a_model_too_big_comes_back_with_the_placement_that_fits(qtbot, backend, worker):
    rec = Recorder(worker)
    proposals: list[LoadRequest] = []
    worker.load_proposed.connect(proposals.append)
    asked = LoadRequest(spec="too-big", dtype="bfloat16", precision="fast")
    with qtbot.waitSignal(worker.load_failed, timeout=5000):
        worker.load(asked)
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)

    assert rec.failures == [TOO_BIG.line]
    # The same request, placed as proposed (the fast model places layers in RAM and on disk)
    assert proposals == [
        LoadRequest(
            spec="too-big", dtype="bfloat16", precision="fast",
            device_map="auto", max_memory="cpu=2048MiB",
        )
    ]  # fmt: skip
    with qtbot.waitSignal(worker.loaded, timeout=5000):
        worker.load(proposals[0])
    assert worker.info.name == "too-big"


def test_a_proposal_that_places_nothing_is_not_offered():
    no_room = ModelLoadError("big needs 9 GB; placed, it would not run either.", replace(
        TOO_BIG, device_map="", max_memory=""
    ))  # fmt: skip
    assert proposed_request(LoadRequest(spec="big"), no_room) is None
    assert proposed_request(LoadRequest(spec="big"), ValueError("damaged")) is None
    placed = proposed_request(LoadRequest(spec="big"), ModelLoadError(TOO_BIG.line, TOO_BIG))
    assert placed == LoadRequest(spec="big", device_map="auto", max_memory="cpu=2048MiB")
    on_gpu = ModelLoadError("big", replace(TOO_BIG, device_map="gpu-layers=3", max_memory=""))
    fast = LoadRequest(spec="big", precision="fast")
    # the fast model places no layers on a GPU: that proposal goes to the exact path
    assert proposed_request(fast, on_gpu) == replace(
        fast, device_map="gpu-layers=3", precision="auto"
    )


def test_an_unexpected_loader_error_is_reported_with_its_type(qtbot, caplog):
    def explode(request, progress):
        raise ValueError("weights are damaged")

    worker = in_memory(explode)
    try:
        rec = Recorder(worker)
        with qtbot.waitSignal(worker.load_failed, timeout=5000):
            worker.load(LoadRequest(spec="x"))
        assert rec.failures == ["ValueError: weights are damaged"]
        assert worker.info is None
        assert "loading 'x' failed" in caplog.text
    finally:
        worker.shutdown()


def test_reset_reaches_the_session(qtbot, backend, worker):
    load(qtbot, worker)
    worker.reset()
    qtbot.waitUntil(lambda: backend.session.resets == 1, timeout=5000)


def test_loading_during_a_reply_stops_it_first(qtbot, backend, worker):
    backend.gate = threading.Semaphore(0)
    load(qtbot, worker, "first")
    rec = Recorder(worker)
    assert worker.generate(HELLO, SETTINGS)
    with qtbot.waitSignal(worker.loaded, timeout=5000):
        worker.load(LoadRequest(spec="second"))
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert [f.reason for f in rec.finished] == ["cancelled"]
    assert worker.info.name == "second"


def test_shutdown_mid_reply_is_quick_and_leaves_no_thread(qtbot, backend, worker):
    backend.gate = threading.Semaphore(0)
    load(qtbot, worker)
    assert worker.generate(HELLO, SETTINGS)
    qtbot.waitUntil(backend.session.started.is_set, timeout=5000)

    started = time.perf_counter()
    worker.shutdown()
    assert time.perf_counter() - started < 2
    assert not worker.is_running()
    assert not worker.busy
    worker.shutdown()  # twice is fine
    assert not worker.generate(HELLO, SETTINGS)


def test_the_engine_clients_receiver_prepares_each_batch_off_the_gui_thread(qtbot, caplog):
    """The engine process's client runs the window's preparer on every event in its receiving
    thread, before the GUI thread gets them; a preparer that fails is dropped (logged) and the
    reply still arrives whole."""
    from app.server.engine_process import EngineProcess
    from tests.app.server.test_engine_process import FAKE, fake_request
    from tests.app.server.test_engine_process import load as load_engine

    worker = EngineClient(EngineProcess(FAKE))
    try:
        load_engine(qtbot, worker, fake_request(tokens=40))
        prepared: list = []
        threads: set = set()

        def prepare(events: list) -> None:
            threads.add(threading.get_ident())
            prepared.extend(events)

        worker.set_preparer(prepare)
        recorder = Recorder(worker)
        reply(qtbot, worker)
        assert prepared and [id(e) for e in prepared] == [id(e) for e in recorder.events]
        assert threading.get_ident() not in threads  # not the GUI thread

        def broken(_events: list) -> None:
            raise ValueError("cannot prepare")

        worker.set_preparer(broken)
        recorder = Recorder(worker)
        reply(qtbot, worker)
        assert worker.preparer is None and "preparing events" in caplog.text
        assert len(recorder.finished) == 1 and recorder.finished[0].generated_tokens == 40
    finally:
        worker.shutdown()


def test_pace_holds_steps_and_resumes_a_reply_through_the_server(qtbot, backend, worker):
    """Pace requests act as they arrive, like Stop: a reply held after its prompt takes one
    step per Next token, then runs on when resumed, with the unpaced reply's text."""
    load(qtbot, worker)
    rec = Recorder(worker)
    stepped = GenerationSettings(greedy=True, pause_after_prefill=True)
    assert worker.generate(HELLO, stepped)
    pacer = backend.session.pacer
    qtbot.waitUntil(lambda: pacer.pace.waiting, timeout=5000)
    for shown in (1, 2):
        worker.pace("step")
        qtbot.waitUntil(
            lambda shown=shown: (
                sum(isinstance(e, Token) for e in rec.events) == shown and pacer.pace.waiting
            ),
            timeout=5000,
        )
    assert worker.busy and not rec.finished  # held, not over
    worker.pace("resume")
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert rec.finished[0].reason == "eos" and rec.finished[0].text == "".join(backend.pieces)
    with pytest.raises(ValueError, match="above 0"):
        worker.pace("play", 0)


def test_stop_ends_a_held_reply_through_the_server(qtbot, backend, worker):
    load(qtbot, worker)
    rec = Recorder(worker)
    assert worker.generate(HELLO, GenerationSettings(greedy=True, pause_after_prefill=True))
    qtbot.waitUntil(lambda: backend.session.pacer.pace.waiting, timeout=5000)
    worker.stop()
    qtbot.waitUntil(lambda: not worker.busy, timeout=5000)
    assert rec.finished[0].reason == "cancelled" and rec.finished[0].text == ""
    worker.pace("resume")
