"""Large arrays cross from the engine through shared memory: equal, read-only, nothing left
behind; small ones, and any a full or missing folder refuses, go through the pipe."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from app.server.pipe import receive_message, send_message
from app.server.shared_arrays import (
    MAX_WAITING_FILES,
    MIN_SHARED_BYTES,
    PREFIX,
    SharedFolder,
    remove_stale,
    take,
)
from engine.events import PrefillDone, frozen_array


def prefill(rng: np.random.Generator, keys: int) -> PrefillDone:
    """A prompt's attention rows: 4 layers x [9 heads, 64 rows, keys], float32."""
    attention = {
        layer: frozen_array(rng.random((9, 64, keys), dtype=np.float32)) for layer in range(4)
    }
    return PrefillDone(keys, 0, keys, 0.0, 0.1, 0, (), (), (), attention=attention)


def cross(message, shared: SharedFolder | None, seen: list[list[str]] | None = None):
    """`message` through a pipe as the engine sends it; `seen` gets the folder's files while
    the reader has not read yet."""
    reader, writer = multiprocessing.Pipe(duplex=False)
    sent: list[int] = []

    def send() -> None:
        sent.append(send_message(writer, message, shared))
        if seen is not None and shared is not None:
            seen.append(sorted(os.listdir(shared.path)))

    sender = threading.Thread(target=send)
    try:
        sender.start()
        if seen is not None:  # the arrays are written before the small frames that name them
            sender.join(10)
        back, received = receive_message(reader)
        sender.join(10)
    finally:
        reader.close()
        writer.close()
    assert sent == [received]
    return back, received


@pytest.fixture
def shared(tmp_path):
    folder = SharedFolder.create(tmp_path)
    assert folder is not None
    yield folder
    folder.remove()


def test_a_prompts_rows_cross_through_shared_memory_and_nothing_is_left(shared):
    event = prefill(np.random.default_rng(0), keys=1_000)  # 2.3 MB a layer
    assert event.attention[0].nbytes >= MIN_SHARED_BYTES
    seen: list[list[str]] = []
    (kind, _queued, (back,)), received = cross(("events", 0.0, [event]), shared, seen)

    assert seen == [["0", "1", "2", "3"]]  # one file an array, until the window took them
    assert os.listdir(shared.path) == []  # unlinked as soon as they were mapped
    assert kind == "events" and back.prompt_tokens == 1_000
    assert received >= 4 * event.attention[0].nbytes
    for layer, array in event.attention.items():
        arrived = back.attention[layer]
        np.testing.assert_array_equal(arrived, array)
        assert arrived.dtype == np.float32 and not arrived.flags.writeable


def test_small_arrays_go_through_the_pipe(shared, monkeypatch):
    event = prefill(np.random.default_rng(1), keys=100)  # 230 KB a layer
    written: list[int] = []
    write = shared.write
    monkeypatch.setattr(shared, "write", lambda data: written.append(data.nbytes) or write(data))
    (_kind, _queued, (back,)), _ = cross(("events", 0.0, [event]), shared)
    assert written == []
    for layer, array in event.attention.items():
        np.testing.assert_array_equal(back.attention[layer], array)


def test_a_folder_that_refuses_a_write_leaves_the_array_to_the_pipe(shared):
    event = prefill(np.random.default_rng(2), keys=1_000)
    shared.remove()  # as a full /dev/shm would refuse it
    (_kind, _queued, (back,)), _ = cross(("events", 0.0, [event]), shared)
    for layer, array in event.attention.items():
        np.testing.assert_array_equal(back.attention[layer], array)
        assert not back.attention[layer].flags.writeable


def test_a_window_that_is_behind_gets_arrays_through_the_pipe_again(shared):
    """The pipe blocks the engine while the window is behind; files would not."""
    data = memoryview(np.zeros(MIN_SHARED_BYTES // 4, dtype=np.float32))
    paths = [shared.write(data) for _ in range(MAX_WAITING_FILES)]
    assert None not in paths and shared.write(data) is None
    take(paths[0])
    assert shared.write(data) is not None


def test_without_shared_memory_there_is_no_folder_and_the_pipe_carries_everything(tmp_path):
    assert SharedFolder.create(tmp_path / "missing") is None
    event = prefill(np.random.default_rng(3), keys=1_000)
    (_kind, _queued, (back,)), _ = cross(("events", 0.0, [event]), None)
    np.testing.assert_array_equal(back.attention[3], event.attention[3])


def test_a_taken_array_outlives_its_file(shared):
    data = np.arange(MIN_SHARED_BYTES // 8, dtype=np.float64)
    path = shared.write(memoryview(data))
    assert path is not None and Path(path).exists()
    view = take(path)
    assert not Path(path).exists() and view.readonly
    np.testing.assert_array_equal(np.frombuffer(view, dtype=np.float64), data)


def test_folders_of_processes_that_are_gone_are_removed_at_the_next_start(tmp_path):
    command = [sys.executable, "-c", "import os; print(os.getpid())"]
    gone = subprocess.run(command, check=True, capture_output=True, text=True)
    dead = tmp_path / f"{PREFIX}{int(gone.stdout)}-abc"
    live = tmp_path / f"{PREFIX}{os.getpid()}-def"
    other = tmp_path / "not-ours"
    for folder in (dead, live, other):
        folder.mkdir()
        (folder / "0").write_bytes(b"x")
    remove_stale(tmp_path)
    assert not dead.exists() and live.exists() and other.exists()
