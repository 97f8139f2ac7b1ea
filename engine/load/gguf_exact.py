"""The GGUF routes through transformers' models, nothing written to disk but what a placement
puts there:

- `gguf exact`: the transformers model of a GGUF Glassbox's own model reads, every weight
  dequantised to the request's dtype from the file (engine/model/reference.py). Unplaced, it is
  refused up front where the device cannot hold it, proposing the placement that would;
  placed, the plan is made on the model's skeleton before anything is dequantised, and the
  disk-placed weights are written to disk as they are made, so RAM never holds them all.
- `gguf other`: a GGUF of another architecture, through transformers' own GGUF reader,
  dequantised in memory to bf16 (half float32's memory), then placed if asked.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.gguf.reader import GGUFError, GGUFFile
from engine.load.fits import check_exact_fits, out_of_memory
from engine.load.loaded import (
    LoadedModel,
    ModelLoadError,
    Progress,
    finish,
    per_tensor,
    prepare,
    short,
)
from engine.load.placed import place, placement_note, plan, with_placement
from engine.load.route import Route
from engine.load.tokenizer import gguf_tokenizer
from engine.model.gguf_shape import Unsupported
from engine.model.reference import build_exact, exact_bytes, exact_skeleton
from engine.placement.dispatch import DiskWriter, offload_folder, place_in_memory
from engine.placement.plan import DeviceMapDict

if TYPE_CHECKING:  # transformers is imported only on the paths that need it
    from transformers import PreTrainedModel


def load(route: Route, report: Progress) -> LoadedModel:
    """The dequantised transformers model and its tokenizer, placed as the request says."""
    file, path, request, dtype = route.gguf, Path(route.location), route.request, route.dtype
    tokenizer = gguf_tokenizer(path, route.cache, report)
    mapping: DeviceMapDict | None = None
    writer: DiskWriter | None = None
    try:  # a placed load's plan, or an unplaced one's fit check, before anything is dequantised
        if request.placed:
            mapping = plan(exact_skeleton(file, dtype), request, route.device)
            writer = DiskWriter(mapping, offload_folder(route.cache))
        else:
            check_exact_fits(file, route.name, route.device, dtype)
        model = _dequantise(file, dtype, report, writer)
    except (torch.OutOfMemoryError, MemoryError):
        needed = exact_bytes(file, dtype)
        raise out_of_memory(
            route.name, needed, route.device, lambda: exact_skeleton(file, dtype)
        ) from None
    except (Unsupported, GGUFError, ValueError, RuntimeError) as error:
        raise ModelLoadError(f"{path} could not be loaded: {short(error)}") from None
    if mapping is None:
        return finish(model, tokenizer, route.name, route.source, route.device, report)
    note = placement_note(request)
    placed = place_in_memory(model, mapping, route.device, route.cache, note, writer)
    return with_placement(prepare(model, tokenizer, name=route.name, source=route.source), placed)


def _dequantise(
    file: GGUFFile, dtype: torch.dtype, report: Progress, writer: DiskWriter | None
) -> PreTrainedModel:
    """The exact model, its disk-placed weights written by `writer` (removed if it fails)."""
    try:
        model = build_exact(
            file, dtype, per_tensor(report, "Dequantising the weights", 0.3, 0.9), writer
        )
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            shutil.rmtree(writer.folder, ignore_errors=True)
        raise
    return model


def load_other(route: Route, report: Progress) -> LoadedModel:
    """transformers' own GGUF reader, for an architecture Glassbox's model does not read."""
    path, request = Path(route.location), route.request
    tokenizer = gguf_tokenizer(path, route.cache, report)
    wanted = torch.bfloat16 if request.dtype == "auto" else route.dtype
    model = _transformers_gguf(path, route.unsupported or "", wanted, report)
    if not request.placed:
        return finish(model, tokenizer, route.name, route.source, route.device, report)
    report("Placing the layers", 0.95)
    loaded = prepare(model, tokenizer, name=route.name, source=route.source)
    return place(loaded, request, route.device, route.cache)


def _transformers_gguf(
    gguf: Path, unsupported: str, dtype: torch.dtype, report: Progress
) -> PreTrainedModel:
    """Every weight dequantised in memory to `dtype` (no copy on disk)."""
    from transformers import AutoModelForCausalLM

    report("Dequantising the GGUF in transformers", 0.3)
    try:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype
        )
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"{gguf.name} does not fit in memory once dequantised.") from None
    except Exception as error:  # the gguf reader raises many kinds on a damaged file
        raise ModelLoadError(
            f"{gguf} is not a readable GGUF model: Glassbox's own model cannot run it"
            f" ({unsupported}) and transformers' GGUF reader failed: {short(error)}"
        ) from None
    return model
