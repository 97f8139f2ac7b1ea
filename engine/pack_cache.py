"""A GGUF's 4-bit weights as the int4 kernel reads them, repacked once and kept on disk.

Repacking the bundled model takes ~2 s (its Q8_0 lm_head, requantised to 4 bits, is most of
it); the packed tensors come back from a memory-mapped file in a few milliseconds. The pack
holds the kernel's own bytes (packed nibbles, bf16 scales and zeros: ~80 MB for the bundled
model), never a float copy. Its name carries the GGUF's identity (path, size, modification
time), torch's version (the packed layout is torch's) and FORMAT, so a changed file, a new
torch or a new layout simply misses. An entry whose shapes do not fit the model, or a file that
does not load, is ignored: those weights are repacked and the pack is written anew.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.quant import BLOCK, Int4Linear

log = logging.getLogger(__name__)

FORMAT = 1  # bump when what is stored, or how it is built, changes


def pack_path(folder: Path, stem: str, file_key: str) -> Path:
    """Where the pack of a GGUF (named by `stem`, identified by `file_key`) is kept."""
    version = torch.__version__.replace("+", "-")
    return folder / f"{stem}-{file_key}-torch{version}-v{FORMAT}.pt"


class PackCache:
    """Int4Linear weights by name: from the pack file when it holds them, else built and kept
    for `save()`. `stem` names the GGUF: older packs of the same name go when one is saved."""

    def __init__(self, path: Path, stem: str) -> None:
        self.path, self.stem = path, stem
        self.stored = _read(path)
        self.missed = False
        self.entries: dict[str, dict[str, torch.Tensor | int]] = {}

    def linear(
        self, name: str, out_features: int, in_features: int, build: Callable[[], Int4Linear]
    ) -> Int4Linear:
        """The stored linear `name` if it fits [out_features, in_features], else `build()`."""
        entry = self.stored.get(name)
        if entry is not None and _fits(entry, out_features, in_features):
            linear = Int4Linear(entry["packed"], entry["scales_zeros"], out_features)
        else:
            self.missed = True
            linear = build()
        self.entries[name] = {
            "packed": linear.packed,
            "scales_zeros": linear.scales_zeros,
            "out_features": linear.out_features,
        }
        return linear

    def save(self) -> None:
        """Write the pack if anything was built (atomically; older packs of the file go)."""
        if not self.missed or not self.entries:
            return
        folder, staging = self.path.parent, None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            handle, staging = tempfile.mkstemp(dir=folder, prefix=".partial-", suffix=".pt")
            os.close(handle)
            torch.save(self.entries, staging)
            os.replace(staging, self.path)
        except OSError as error:  # a read-only or full cache folder costs the next start only
            log.warning("could not keep the packed weights in %s: %s", folder, error)
            if staging is not None:
                Path(staging).unlink(missing_ok=True)
            return
        for old in _packs_of(folder, self.stem):
            if old != self.path:
                old.unlink(missing_ok=True)


def _packs_of(folder: Path, stem: str) -> list[Path]:
    """The packs named for `stem` (any key, torch, format), not those of a GGUF whose name
    merely starts with it: the key after the stem has no dash, so "model-b-KEY-torch..."
    is not a pack of "model"."""
    pattern = re.compile(re.escape(stem) + r"-[^-]+-torch.+-v\d+\.pt")
    return [path for path in folder.glob(f"{stem}-*.pt") if pattern.fullmatch(path.name)]


def _read(path: Path) -> dict[str, Any]:
    """The stored entries, mapped from the file (pages are read as the kernels touch them)."""
    if not path.is_file():
        return {}
    try:
        stored = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as error:  # damaged, truncated or not a pack: repack
        log.warning("ignoring the damaged weight pack %s: %s", path.name, error)
        return {}
    return stored if isinstance(stored, dict) else {}


def _fits(entry: object, out_features: int, in_features: int) -> bool:
    """Whether a stored entry has the shapes and dtypes of an Int4Linear [out, in]."""
    if not isinstance(entry, dict):
        return False
    packed, scales, out = entry.get("packed"), entry.get("scales_zeros"), entry.get("out_features")
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor):
        return False
    rows = packed.shape[0] if packed.dim() == 2 else -1
    return (
        out == out_features
        and rows in (out_features, 2 * out_features)  # 2x: a Q8_0 weight split in two halves
        and packed.dtype == torch.uint8
        and tuple(packed.shape) == (rows, in_features // 2)
        and scales.dtype == torch.bfloat16
        and tuple(scales.shape) == (in_features // BLOCK, rows, 2)
    )
