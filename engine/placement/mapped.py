"""Placement of Glassbox's own GGUF model: its "disk" is the mapped file, read through the OS.

accelerate's exact path copies each offloaded layer from its offload folder into fresh
memory before every pass, cached or not. The fast model's disk-placed layers instead compute
straight from views of mapped files: the GGUF's own blocks where the GGML kernels read them,
the pack cache's 4-bit repacks otherwise (engine/weights/pack_cache.py). Nothing is copied and
nothing is written: storage is read only for pages the OS does not hold in its page cache,
and while RAM is spare it holds them all, so such a step costs what an in-memory one does.
The RAM cap bounds what Glassbox itself holds (the RAM-placed layers, copied in whole); the
OS decides what of the file stays cached, and takes it back first when memory runs short.

Before a disk-placed layer runs, its pages are checked (mincore) and those the cache lacks
are read in at once (read_in), timed: what a step waits for here. The kernel reads ahead
as it does for any mapped file, so the next layer's pages may arrive while this one
computes: the wait is what the step lost to reading, the rest overlapped. When a step finds
pages missing the OS is short of memory, and the step drops each layer behind it (the
MappedMeter's drop-behind) rather than let the kernel evict the next layers. A step's
bytes are the kernel's own count of what the process read from storage meanwhile
(/proc/self/io), which also takes in the embedding's and the head's rows a token looks up for
the first time (the mapped GGUF, wherever the layers are); each step is predicted from the
pages missing when it began and the read bandwidth measured at load.
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import logging
import mmap
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from engine.events import Placement
from engine.placement.dispatch import summary

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux 5.14+: fault the range in now, reading what is missing
MADV_WILLNEED, MADV_DONTNEED = 3, 4
PROBE_PASSES = 8  # a pass that drops behind keeps its pages every this many: is RAM back?

# A range of mapped memory: (page-aligned address, length in bytes).
Span = tuple[int, int]


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _mapped_files() -> list[tuple[int, int, str, int]]:
    """(start, end, path, file offset at start) of each mapping of a file in this process,
    from one read of /proc/self/maps."""
    found = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            path = fields[5].strip() if len(fields) > 5 else ""
            if path.startswith("/") and not path.endswith(" (deleted)"):
                low, high = (int(x, 16) for x in fields[0].split("-"))
                found.append((low, high, path, int(fields[2], 16)))
    return found


def file_backed(spans: Iterable[Span]) -> list[bool]:
    """For each span, whether it lies in a mapping of a file (not anonymous memory)."""
    starts: list[int] = []
    ends: list[int] = []
    last_path = ""
    for low, high, path, _ in _mapped_files():
        if ends and ends[-1] == low and path == last_path:  # one mapping, split by an
            ends[-1] = high  # madvise on part of it
        else:
            starts.append(low)
            ends.append(high)
        last_path = path
    result = []
    for address, length in spans:
        index = bisect.bisect_right(starts, address) - 1
        result.append(index >= 0 and address + length <= ends[index])
    return result


def span(tensor: torch.Tensor) -> Span:
    """The pages a contiguous tensor's bytes lie on."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    low = start - start % PAGE
    return low, -(-(end - low) // PAGE) * PAGE


def weights(module: torch.nn.Module) -> list[torch.Tensor]:
    """The module's buffers and parameters, each storage once."""
    seen: set[int] = set()
    found = []
    for tensor in (*module.buffers(), *module.parameters()):
        if tensor.numel() and tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            found.append(tensor)
    return found


def hold(module: torch.nn.Module) -> None:
    """Copy the module's file-backed weights into memory of its own (a RAM-placed layer whose
    repacks were mapped from the pack cache)."""
    found = [
        (owner, name, buffer)
        for owner in module.modules()
        for name, buffer in owner.named_buffers(recurse=False)
        if buffer.numel()
    ]
    backed = file_backed(span(buffer) for _, _, buffer in found)  # one read of the maps
    for (owner, name, buffer), in_file in zip(found, backed, strict=True):
        if in_file:
            owner.register_buffer(name, buffer.clone(), persistent=False)


def mapped_spans(module: torch.nn.Module) -> tuple[list[Span], int]:
    """The file-backed pages of the module's weights (merged), and the bytes it holds in
    memory of its own (copies: llama's reordered q/k rows, norms, bf16 fallbacks)."""
    tensors = weights(module)
    backed = file_backed(span(t) for t in tensors)
    spans = sorted(span(t) for t, b in zip(tensors, backed, strict=True) if b)
    held = sum(t.numel() * t.element_size() for t, b in zip(tensors, backed, strict=True) if not b)
    merged: list[Span] = []
    for address, length in spans:
        if merged and address <= merged[-1][0] + merged[-1][1]:
            low, size = merged[-1]
            merged[-1] = (low, max(size, address + length - low))
        else:
            merged.append((address, length))
    return merged, held


def storage_read_bytes() -> int:
    """Bytes this process has had read from storage (page faults and reads alike)."""
    with open("/proc/self/io") as counters:
        for line in counters:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


def missing_bytes(address: int, length: int, vector: np.ndarray | None = None) -> int:
    """Bytes of the range whose pages the page cache does not hold (mincore); `vector`: room
    for its answer, a byte a page (made when not given)."""
    pages = length // PAGE
    vector = np.empty(pages, np.uint8) if vector is None else vector
    result = _libc().mincore(
        ctypes.c_void_p(address), ctypes.c_size_t(length), ctypes.c_void_p(vector.ctypes.data)
    )
    if result:  # not answerable (never for a live mapping): read nothing ahead
        return 0
    return int(pages - np.count_nonzero(vector)) * PAGE  # bit 0 is residency; the rest 0


def _advise(address: int, length: int, advice: int) -> int:
    result: int = _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), advice)
    return result


def read_in(address: int, length: int) -> None:
    """Read the range's missing pages in now: asked for at once (MADV_WILLNEED: as much as
    the device's read-ahead allows, the whole of a small layer), then waited for and mapped
    (MADV_POPULATE_READ, the rest read around its faults); before Linux 5.14, by touching a
    byte of each page."""
    _advise(address, length, MADV_WILLNEED)
    if _advise(address, length, MADV_POPULATE_READ):
        pages = np.ctypeslib.as_array((ctypes.c_ubyte * length).from_address(address))
        pages[::PAGE].sum()


def drop(address: int, length: int, located: tuple[str, int] | None = None) -> None:
    """Take the range out of this process and out of the page cache (to time a real read);
    `located`: file_offset(address), when the caller has it already."""
    _advise(address, length, MADV_DONTNEED)
    located = located or file_offset(address)
    if located is None:
        return
    path, offset = located
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(descriptor, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def file_offset(address: int) -> tuple[str, int] | None:
    """The file mapped at `address`, and the offset in it of the byte there; None: none."""
    return file_offsets([address]).get(address)


def file_offsets(addresses: list[int]) -> dict[int, tuple[str, int]]:
    """file_offset of each address that lies in a mapped file, from one read of the maps."""
    found: dict[int, tuple[str, int]] = {}
    for low, high, path, offset in _mapped_files():
        for address in addresses:
            if low <= address < high:
                found[address] = path, offset + address - low
    return found


class MappedMeter:
    """Reads each disk-placed unit's missing pages in before it runs, timed; per pass, what
    storage gave (`begin()`, then `take()` -> (bytes, seconds)) and what was predicted."""

    def __init__(self, spans: dict[int, list[Span]]) -> None:
        self.spans = spans
        self.bytes = self.missing = self._read_before = 0
        self.seconds = 0.0
        self.read_bytes_per_s = 0.0  # measured at load; 0 until then
        self._vectors = {s: np.empty(s[1] // PAGE, np.uint8) for u in spans.values() for s in u}
        # the units a metered pass found pages missing in (None outside one: check them all)
        self._short: set[int] | None = None
        self.files = file_offsets([span[0] for unit in spans.values() for span in unit])
        self._passes = 0
        self.dropping = False  # this pass drops each disk-placed unit once it has run
        self._ran: int | None = None  # the disk-placed unit that ran last in this pass

    def __call__(self, unit: int) -> None:
        """Before unit `unit` (a layer's index; the head's is the layer count) runs."""
        spans = self.spans.get(unit)
        if not spans:
            return
        self._drop_behind(unit)
        if self._short is not None and unit not in self._short:
            return
        start = time.perf_counter()
        for span in spans:
            if missing_bytes(*span, self._vectors[span]):
                read_in(*span)
        self.seconds += time.perf_counter() - start

    def drop_all(self) -> None:
        """Every disk-placed page out of this process and the page cache, as the OS drops
        them when memory runs short."""
        for spans in self.spans.values():
            for span in spans:
                drop(*span, self.files.get(span[0]))

    def _drop_behind(self, unit: int | None) -> None:
        """When the OS is short of memory, the unit that just ran leaves the page cache: it
        is the one needed latest again, where the kernel's own eviction would take the
        pages used longest ago (the next units', the program's code) and read them again."""
        if self.dropping and self._ran is not None:
            for span in self.spans[self._ran]:
                drop(*span, self.files.get(span[0]))
        self._ran = unit

    def begin(self, drop_behind: bool = True) -> None:
        """Before a pass: what it will find missing, checked before any read-in (whose
        read-ahead brings the next unit's pages in early: some while this one computes)."""
        start = time.perf_counter()
        self._read_before = storage_read_bytes()
        self.missing, self._short = 0, set()
        for unit, spans in self.spans.items():
            missing = sum(missing_bytes(*span, self._vectors[span]) for span in spans)
            if missing:
                self.missing += missing
                self._short.add(unit)
        # Pages went missing since the last pass: the OS is evicting them, so this pass
        # drops behind it. Every PROBE_PASSES-th pass keeps its pages instead: where memory
        # has come back, the next pass finds none missing and stops dropping.
        self._passes += drop_behind
        self.dropping = drop_behind and bool(self.missing) and self._passes % PROBE_PASSES != 0
        self.seconds = time.perf_counter() - start

    def take(self) -> tuple[int, float]:
        """The bytes this process read from storage since `begin()`, and the seconds the
        read-ins waited for them."""
        self._drop_behind(None)
        self.bytes, self._short = storage_read_bytes() - self._read_before, None
        return self.bytes, self.seconds

    def predicted_s(self) -> float | None:
        """The last pass's read, predicted from the pages missing when it began."""
        if self.read_bytes_per_s <= 0:
            return 0.0
        return self.missing / self.read_bytes_per_s


@dataclass(frozen=True, slots=True)
class MappedPlacement:
    """A fast model's placement: its event, and the meter its disk-placed units run behind
    (None when every unit is in RAM: nothing to read in, nothing on the decode path)."""

    placement: Placement
    meter: MappedMeter | None


def place(
    model: torch.nn.Module, units: list[tuple[str, torch.nn.Module]], places: dict[str, str],
    note: str,
) -> MappedPlacement:  # fmt: skip
    """Hold the RAM-placed units in memory, meter the disk-placed ones, and measure what a
    pass costs. `units`: (name, module) in the order a pass runs them, the decoder layers
    ("model.layers.N") then the head; the model calls its `read_in` with each one's index."""
    disk_spans: dict[int, list[Span]] = {}
    per_place = {"cpu": 0, "disk": 0}
    unit_bytes: list[int] = []
    for index, (name, module) in enumerate(units):
        if places[name] == "disk":
            spans, held = mapped_spans(module)
            disk_spans[index] = spans
            mapped = sum(length for _, length in spans)
        else:
            hold(module)
            mapped, held = 0, sum(t.numel() * t.element_size() for t in weights(module))
        per_place["disk"] += mapped
        per_place["cpu"] += held
        unit_bytes.append(mapped + held)
    meter = MappedMeter(disk_spans) if disk_spans else None
    compute_s = 0.0
    if meter is not None:
        model.read_in = meter  # type: ignore[assignment]
        compute_s = _probe(model, meter)
    layers = [i for i, (name, _) in enumerate(units) if name.startswith("model.layers.")]
    placement = Placement(
        layer_places=tuple(places[units[i][0]] for i in layers),
        layer_bytes=tuple(unit_bytes[i] for i in layers),
        place_bytes=tuple(sorted((p, b) for p, b in per_place.items() if b)),
        moved_bytes=per_place["disk"],
        read_bytes_per_s=meter.read_bytes_per_s if meter else 0.0,
        execution_device="cpu",
        note=note,
        compute_s=compute_s,
        mapped=True,
    )
    log.info("placement of the fast model: %s", summary(placement))
    return MappedPlacement(placement, meter)


def _probe(model: torch.nn.Module, meter: MappedMeter, passes: int = 3) -> float:
    """Measure the storage's read speed as a step meets it (every disk-placed page dropped
    from the page cache, then a pass that reads them back), then what a decode step computes:
    the fastest of `passes` one-token passes through a cache, less their reading in."""
    ids = torch.zeros((1, 1), dtype=torch.long)
    cache = model.new_cache()  # type: ignore[operator]
    with torch.inference_mode():
        model(ids, cache, None)  # decode steps run through a cache: so do the passes timed
        meter.drop_all()
        meter.begin(drop_behind=False)
        model(ids, cache, None)
        read, reading = meter.take()
        meter.read_bytes_per_s = read / reading if read and reading > 0 else 0.0
        compute = []
        for _ in range(passes):
            meter.begin(drop_behind=False)
            start = time.perf_counter()
            model(ids, cache, None)
            seconds = time.perf_counter() - start
            compute.append(max(seconds - meter.take()[1], 0.0))
    return min(compute)
