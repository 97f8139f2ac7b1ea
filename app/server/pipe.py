"""Messages over a pipe: a pickle frame whose larger numpy arrays follow as frames of their own.

Replies carry their arrays of INLINE_BYTES or more out of band (pickle protocol 5), written
straight from the arrays' memory, and those of a MB or more through shared memory
(app.server.shared_arrays); smaller read-only ones (a token's per-head statistics) travel inside
the pickle, where two reads of their own for each would cost more than the copy. Events are
pickled as their fields in order and rebuilt by their constructor (`wire_reducers`), not through
the per-field state that a frozen dataclass with slots pickles by default: a token's event costs
a third as much to write and read that way, at every token on both sides of the pipe. Used by
both ends of the engine's child process (app.server.engine_process, app.server.engine_server);
light to import (the window's process imports it before the engine starts, and numpy after).
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import functools
import io
import os
import pickle
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from app.server.shared_arrays import MIN_SHARED_BYTES, SharedFolder, take

PIPE_BYTES = 2**20  # a token's attention rows at 10,000 keys (1.4 MB) in one or two writes
PICKLE_PROTOCOL = 5  # numpy arrays can travel out of band, as their own frames
INLINE, SHARED = 0, 1  # where an array's bytes travel: in the pipe, or in shared memory
INLINE_BYTES = 4096  # smaller arrays travel inside the pickle frame


def _by_fields(cls: type) -> Callable[[Any], tuple[type, tuple[Any, ...]]]:
    names = tuple(field.name for field in dataclasses.fields(cls))

    def reduce(value: Any) -> tuple[type, tuple[Any, ...]]:
        return cls, tuple([getattr(value, name) for name in names])

    return reduce


@functools.cache
def wire_reducers() -> dict[type, Callable[[Any], Any]]:
    """copyreg's table, and each event dataclass whose every field is an argument of its
    constructor pickled by its fields. Built on the first reply sent (in the engine's process:
    importing the events imports numpy)."""
    from engine import events

    classes = [
        cls
        for cls in vars(events).values()
        if isinstance(cls, type)
        and cls.__module__ == events.__name__
        and dataclasses.is_dataclass(cls)
        and all(field.init for field in dataclasses.fields(cls))
    ]
    return {**copyreg.dispatch_table, **{cls: _by_fields(cls) for cls in classes}}


def encode(message: Any) -> bytes:
    """A request (plain pickle: requests are few and small)."""
    return pickle.dumps(message, protocol=PICKLE_PROTOCOL)


def send_message(connection: Connection, message: Any, shared: SharedFolder | None = None) -> int:
    """Write `message` as a pickle frame whose larger arrays follow as frames of their own,
    written straight from the arrays' memory, or, from MIN_SHARED_BYTES on, through `shared`
    memory (the frame then holds the file's path; see app.server.shared_arrays); returns the
    bytes sent."""
    buffers: list[pickle.PickleBuffer] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:
        """False: the buffer follows as a frame of its own; True: it stays in the pickle (a
        small read-only one, which comes back read-only from there too)."""
        raw = buffer.raw()
        if raw.nbytes < INLINE_BYTES and raw.readonly:
            return True
        buffers.append(buffer)
        return False

    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=PICKLE_PROTOCOL, buffer_callback=out_of_band)
    pickler.dispatch_table = wire_reducers()
    pickler.dump(message)
    header = out.getvalue()
    raws = [buffer.raw() for buffer in buffers]
    paths = [_share(raw, shared) for raw in raws]
    kinds = bytes(INLINE if path is None else SHARED for path in paths)
    connection.send_bytes(struct.pack("!I", len(raws)) + kinds + header)
    for raw, path in zip(raws, paths, strict=True):
        connection.send_bytes(raw if path is None else path.encode())
    return 4 + len(kinds) + len(header) + sum(raw.nbytes for raw in raws)


def _share(raw: memoryview, shared: SharedFolder | None) -> str | None:
    if shared is None or raw.nbytes < MIN_SHARED_BYTES:
        return None
    return shared.write(raw)


def receive_message(connection: Connection) -> tuple[Any, int]:
    """Read what `send_message` wrote: (message, bytes). Arrays come back read-only, over
    buffers read from the pipe with the interpreter lock released (no copy under it on POSIX:
    a token's rows at 10,000 keys are 1.4 MB, and the window's thread must not wait for
    them) or mapped from shared memory."""
    first = _read_frame(connection)
    (count,) = struct.unpack_from("!I", first)
    kinds = first[4 : 4 + count]
    buffers = [_buffer(kind, _read_frame(connection)) for kind in kinds]
    size = len(first) + sum(b.nbytes for b in buffers)
    return pickle.loads(memoryview(first)[4 + count :], buffers=buffers), size


def _buffer(kind: int, frame: bytes | bytearray) -> memoryview:
    if kind == SHARED:
        return take(frame.decode())
    return memoryview(frame).toreadonly()


def _read_frame(connection: Connection) -> bytes | bytearray:
    """One frame of Connection.send_bytes; EOFError once the writer is gone."""
    if not hasattr(os, "readv"):  # Windows: a pipe handle, not a file descriptor
        return connection.recv_bytes()
    fd = connection.fileno()
    (size,) = struct.unpack("!i", _read_exact(fd, 4))
    if size == -1:  # over 2 GiB
        (size,) = struct.unpack("!Q", _read_exact(fd, 8))
    return _read_exact(fd, size)


def _read_exact(fd: int, size: int) -> bytearray:
    data = bytearray(size)
    view, done = memoryview(data), 0
    while done < size:
        read = os.readv(fd, [view[done:]])  # releases the interpreter lock while it reads
        if read == 0:
            raise EOFError("the engine's pipe was closed")
        done += read
    return data


def widen_pipe(connection: Connection) -> None:
    """Let one write carry a long token at once (Linux); elsewhere the default stays."""
    try:
        import fcntl
    except ImportError:  # Windows
        return
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is not None:
        with contextlib.suppress(OSError):
            fcntl.fcntl(connection.fileno(), set_size, PIPE_BYTES)
