"""Read a GGUF file's metadata and tensors without copying or converting them.

`gguf.GGUFReader` builds a numpy view for every string of the vocabulary (seconds for a 49k
vocabulary); this reader parses the header with `struct`, skips string arrays until someone asks
for them, and memory-maps the tensor data, so opening a model file takes milliseconds.
Layout (GGUF v2/v3, little-endian): magic, version, tensor count, metadata count, metadata
(key, type, value), tensor infos (name, dims, ggml type, offset), padding, tensor data.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# metadata value type -> struct format (fixed-size scalars)
SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
STRING, ARRAY = 8, 9
_LENGTH = struct.Struct("<Q")  # a string's length prefix
# ggml tensor type -> (name, values per block, bytes per block)
TENSOR_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2),
}  # fmt: skip


# Types of files one may download that this reader does not hold (llama.cpp's numbering)
UNREAD_TYPES = {
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}  # fmt: skip


def unread_type(tensor: str, kind: int) -> str:
    """Why a tensor of ggml type `kind` stops the read, and which files do read."""
    named = f"{UNREAD_TYPES[kind]} (ggml type {kind})" if kind in UNREAD_TYPES else f"type {kind}"
    readable = ", ".join(name for name, _, _ in TENSOR_TYPES.values())
    return (
        f"tensor {tensor} is {named}, which Glassbox does not read: choose a file of {readable}"
        " (a Q4_K_M file, for example)"
    )


class GGUFError(ValueError):
    """The file is not a GGUF this reader understands; the message says what is wrong."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: rows first ([out, in] for a weight)
    type: int
    offset: int  # from the start of the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return TENSOR_TYPES.get(self.type, (f"type {self.type}", 0, 0))[0]


@dataclass(frozen=True)
class _StringArray:
    start: int
    count: int


class GGUFFile:
    """Metadata and memory-mapped tensors of one GGUF file; `close()` unmaps it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as handle:
            if not self.path.stat().st_size:
                raise GGUFError("the file is empty")
            # Copy-on-write: tensors made from the map are writable (torch warns on read-only
            # buffers) while nothing is ever written back to the file.
            self.mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            self.metadata, self.tensors = self._parse()
        except GGUFError:
            self.close()
            raise
        except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as error:
            # ValueError: numpy's reads past the end, and bytes that are not UTF-8
            self.close()
            raise GGUFError(f"damaged or truncated header ({type(error).__name__})") from None

    # -- reading -----------------------------------------------------------------------------

    def get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key, default)
        return self._strings(value) if isinstance(value, _StringArray) else value

    def raw(self, name: str) -> np.ndarray:
        """A tensor's bytes as uint8 [rows, row_bytes], a view of the mapped file (no copy):
        pages are read when touched, so a lookup table costs only the rows looked up."""
        info = self.tensors[name]
        return np.frombuffer(self.mapping, np.uint8, info.nbytes, info.offset).reshape(
            _rows(info), -1
        )

    def adjacent(self, first: str, second: str) -> bool:
        """Whether tensor `second` starts where `first` ends, with rows of the same bytes (one
        view can hold both, as a fused weight)."""
        a, b = self.tensors[first], self.tensors[second]
        same_rows = a.nbytes // _rows(a) == b.nbytes // _rows(b)
        return same_rows and a.offset + a.nbytes == b.offset

    def raw_run(self, names: list[str]) -> np.ndarray:
        """The rows of adjacent tensors (see `adjacent`) as one view of the mapped file."""
        first = self.tensors[names[0]]
        rows = sum(_rows(self.tensors[n]) for n in names)
        size = sum(self.tensors[n].nbytes for n in names)
        return np.frombuffer(self.mapping, np.uint8, size, first.offset).reshape(rows, -1)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """A copy of a tensor's bytes (rows start..stop) as uint8 [rows, row_bytes], read with
        one system call (far faster than faulting the same pages in through the map)."""
        info = self.tensors[name]
        rows = _rows(info)
        row_bytes = info.nbytes // rows
        stop = rows if stop is None else min(stop, rows)
        data = np.empty((stop - start) * row_bytes, np.uint8)
        with self.path.open("rb") as handle:
            handle.seek(info.offset + start * row_bytes)
            # numpy's stubs do not declare the buffer protocol its arrays implement
            if handle.readinto(data) != data.nbytes:  # type: ignore[arg-type]
                raise GGUFError(f"tensor {name} runs past the end of the file (truncated?)")
        return data.reshape(stop - start, row_bytes)

    def close(self) -> None:
        if self.mapping is not None and not self.mapping.closed:
            with contextlib.suppress(BufferError):  # a view is alive; the map goes with it
                self.mapping.close()

    # -- parsing -----------------------------------------------------------------------------

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        buf = self.mapping
        if buf[:4] != MAGIC:
            raise GGUFError("not a GGUF file (bad magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise GGUFError(f"GGUF version {version} is not supported")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            metadata[key], pos = self._value(kind, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = self._string(pos)
            (dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{dims}Q", buf, pos + 4)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * dims)
            pos += 4 + 8 * dims + 12
            infos.append((name, tuple(reversed(shape)), kind, offset))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        tensors = {}
        for name, shape, kind, offset in infos:
            if kind not in TENSOR_TYPES:
                raise GGUFError(unread_type(name, kind))
            _, per_block, block_bytes = TENSOR_TYPES[kind]
            values = int(np.prod(shape))
            nbytes = values // per_block * block_bytes
            start = data_start + offset
            if start + nbytes > len(buf):
                raise GGUFError(f"tensor {name} runs past the end of the file (truncated?)")
            tensors[name] = TensorInfo(name, shape, kind, start, nbytes)
        return metadata, tensors

    def _string(self, pos: int) -> tuple[str, int]:
        (length,) = struct.unpack_from("<Q", self.mapping, pos)
        end = pos + 8 + length
        if end > len(self.mapping):
            raise GGUFError("a metadata string runs past the end of the file")
        return self.mapping[pos + 8 : end].decode("utf-8"), end

    def _value(self, kind: int, pos: int) -> tuple[Any, int]:
        if kind in SCALARS:
            fmt = "<" + SCALARS[kind]
            return struct.unpack_from(fmt, self.mapping, pos)[0], pos + struct.calcsize(fmt)
        if kind == STRING:
            return self._string(pos)
        if kind != ARRAY:
            raise GGUFError(f"unknown metadata type {kind}")
        item, count = struct.unpack_from("<IQ", self.mapping, pos)
        pos += 12
        if item in SCALARS:
            dtype = np.dtype("<" + SCALARS[item])
            end = pos + dtype.itemsize * count
            if end > len(self.mapping):
                raise GGUFError("a metadata array runs past the end of the file (truncated?)")
            return np.frombuffer(self.mapping, dtype, count, pos).copy(), end
        if item == STRING:  # skipped now, decoded on request (vocabularies are large)
            start, buf, length_at = pos, self.mapping, _LENGTH.unpack_from
            for _ in range(count):  # ~100k strings in the bundled model: kept to one call each
                pos += 8 + length_at(buf, pos)[0]
            return _StringArray(start, count), pos
        values = []
        for _ in range(count):
            value, pos = self._value(item, pos)
            values.append(value)
        return values, pos

    def _strings(self, array: _StringArray) -> list[str]:
        pos, out = array.start, []
        for _ in range(array.count):
            text, pos = self._string(pos)
            out.append(text)
        return out


def _rows(info: TensorInfo) -> int:
    return int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
