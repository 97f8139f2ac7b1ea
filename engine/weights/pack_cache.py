"""A GGUF's weights as the kernels read them, repacked once and kept on disk.

Repacking the bundled model takes seconds (its Q8_0 lm_head, requantised to 4 bits, is most of
it); the packed tensors come back from a memory-mapped file almost at once. The pack
holds the kernels' own bytes (packed nibbles, bf16 scales and zeros: ~80 MB for the bundled
model), and the bf16 copies of weights no int kernel holds exactly (Qwen's Q6_K ffn_down), so
that a second load dequantises nothing either. Its name carries the GGUF's identity (path,
size, modification time), torch's version (the packed layout is torch's) and FORMAT, so a
changed file, a new torch or a new layout simply misses. An entry whose shapes do not fit the
model, or a file that does not load, is ignored: those weights are rebuilt and the pack is
written anew.
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

from engine.gguf.blocks import BLOCK_BYTES, BLOCK_VALUES
from engine.weights import ggml_kernel
from engine.weights.linear import (
    BLOCK,
    DenseLinear,
    GGMLLinear,
    Int4Linear,
    Part,
    Q6KLinear,
    kernel_block_rows,
)

log = logging.getLogger(__name__)

FORMAT = 3  # bump when what is stored, or how it is built, changes
# 2: K-quant and Q5 layouts, bf16 weights kept too, an entry's tensors named by its layout


def pack_path(folder: Path, stem: str, file_key: str) -> Path:
    """Where the pack of a GGUF (named by `stem`, identified by `file_key`) is kept."""
    version = torch.__version__.replace("+", "-")
    layout = f"int4x{kernel_block_rows() or 'op'}"  # the packed bytes differ by kernel set
    return folder / f"{stem}-{file_key}-torch{version}-{layout}-v{FORMAT}.pt"


class PackCache:
    """Weights by name, as the kernels hold them: from the pack file when it holds them, else
    built and kept for `save()`. `stem` names the GGUF: older packs of the same name go when
    one is saved."""

    def __init__(self, path: Path, stem: str) -> None:
        self.path, self.stem = path, stem
        self.stored = _read(path)
        self.missed = False
        self.entries: dict[str, dict[str, torch.Tensor | int]] = {}

    def linear(
        self, name: str, out_features: int, in_features: int, build: Callable[[], Part]
    ) -> Part:
        """The stored linear `name` if it fits [out_features, in_features], else `build()`."""
        linear = _linear(self.stored.get(name), out_features, in_features)
        if linear is None:
            self.missed = True
            linear = build()
        self.entries[name] = _entry(linear)
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


def _entry(linear: Part) -> dict[str, torch.Tensor | int]:
    """What is stored of a linear: its tensors, by the names its class gives them."""
    if isinstance(linear, Int4Linear):
        return {
            "packed": linear.packed,
            "scales_zeros": linear.scales_zeros,
            "out_features": linear.out_features,
        }
    if isinstance(linear, DenseLinear):
        return {"weight": linear.weight}
    if isinstance(linear, GGMLLinear):
        return {"ggml_raw": linear.raw, "ggml_type": linear.qtype}
    return {"q6_packed": linear.packed, "q6_scales_zeros": linear.scales_zeros}


def _linear(entry: object, out_features: int, in_features: int) -> Part | None:
    """The linear a stored entry holds, if it has the shapes and dtypes of one [out, in]."""
    if not isinstance(entry, dict) or not all(
        isinstance(t, torch.Tensor | int) for t in entry.values()
    ):
        return None
    if _fits_int4(entry, out_features, in_features):
        return Int4Linear(entry["packed"], entry["scales_zeros"], out_features)
    weight = entry.get("weight")
    if isinstance(weight, torch.Tensor) and _is(
        weight, torch.bfloat16, (out_features, in_features)
    ):
        return DenseLinear(weight)
    raw, qtype = entry.get("ggml_raw"), entry.get("ggml_type")
    if (
        isinstance(raw, torch.Tensor)
        and isinstance(qtype, int)
        and _ggml_fits(raw, qtype, out_features, in_features)
    ):
        return GGMLLinear(raw, qtype, in_features)
    packed, scales = entry.get("q6_packed"), entry.get("q6_scales_zeros")
    if (
        isinstance(packed, torch.Tensor)
        and isinstance(scales, torch.Tensor)
        and _is(packed, torch.uint8, (out_features, in_features))
        and _is(scales, torch.bfloat16, (in_features // 16, out_features, 2))
    ):
        return Q6KLinear(packed, scales)
    return None


def _ggml_fits(raw: torch.Tensor, qtype: int, out_features: int, in_features: int) -> bool:
    """Whether stored blocks are rows of `qtype` [out, in] the GGML kernels read (loaded)."""
    if not ggml_kernel.holds(qtype):
        return False
    values, size = BLOCK_VALUES[qtype], BLOCK_BYTES[qtype]
    row_bytes = in_features // values * size
    return in_features % values == 0 and _is(raw, torch.uint8, (out_features, row_bytes))


def _is(tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> bool:
    return tensor.dtype == dtype and tuple(tensor.shape) == shape


def _fits_int4(entry: dict[str, Any], out_features: int, in_features: int) -> bool:
    """Whether a stored entry has the shapes and dtypes of an Int4Linear [out, in]."""
    packed, scales, out = entry.get("packed"), entry.get("scales_zeros"), entry.get("out_features")
    if not isinstance(packed, torch.Tensor) or not isinstance(scales, torch.Tensor):
        return False
    rows = packed.shape[0] if packed.dim() == 2 else -1
    return (
        out == out_features
        and rows in (out_features, 2 * out_features)  # 2x: a weight split in two halves
        and _is(packed, torch.uint8, (rows, in_features // 2))
        and _is(scales, torch.bfloat16, (in_features // BLOCK, rows, 2))
    )
