"""The `gguf fast` route: Glassbox's own model (engine/model/llama.py, engine/model/gemma.py) on
the file's 4/8-bit weights, built straight from the memory-mapped file without importing
transformers' modeling code. Its repacked weights are kept in the cache folder
(engine/weights/pack_cache.py) and mapped back in at once on later starts.

On the CPU its decode step is compiled in the background (engine/step/compiled.py); on CUDA it
runs in its GPU form (engine/model/to_device.py) with the static decode step
(engine/step/static.py). Placed (CPU only), its disk-placed layers compute from the mapped file
(engine/placement/mapped.py). Unplaced, it is refused up front where its RAM cannot hold it;
out of memory all the same, it proposes the RAM cap that would fit (engine/load/fits.py).
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.gguf.reader import GGUFError, GGUFFile
from engine.load.fits import check_fast_fits, out_of_memory
from engine.load.loaded import (
    LoadedModel,
    ModelLoadError,
    Progress,
    describe_fast,
    per_tensor,
    short,
    with_pad,
)
from engine.load.placed import placement_note, plan
from engine.load.route import Route
from engine.load.tokenizer import file_key, gguf_tokenizer
from engine.model.fast_builder import build_fast, fast_bytes, fast_skeleton
from engine.model.gguf_shape import Unsupported, read_shape, release_freed_memory
from engine.model.to_device import int4_wanted, to_device
from engine.placement.mapped import MappedPlacement
from engine.placement.mapped import place as place_mapped
from engine.placement.plan import DeviceMapDict
from engine.settings import LoadRequest
from engine.step import compiled as compiled_decode
from engine.step import static as static_decode
from engine.step.compiled import Attacher
from engine.step.static import StepState
from engine.weights.pack_cache import PackCache, pack_path

if TYPE_CHECKING:
    from engine.model.llama import GGUFLlama

log = logging.getLogger(__name__)


def load(route: Route, report: Progress) -> LoadedModel:
    """Glassbox's own model and its tokenizer, placed as the request says (a placed load's
    plan, or an unplaced one's fit check, refuses before anything is read)."""
    file, path, request = route.gguf, Path(route.location), route.request
    places = plan(fast_skeleton(file), request, route.device) if request.placed else None
    if places is None and route.device.type == "cpu":
        check_fast_fits(file, route.name, route.device)
    began = time.perf_counter()
    tokenizer = gguf_tokenizer(path, route.cache, report, lean=True)
    log.info("tokenizer read in %.1f s", time.perf_counter() - began)
    try:
        began = time.perf_counter()
        fast, placed = _build(file, path, places, route, report)
        log.info("weights read in %.1f s", time.perf_counter() - began)
        compiling = _decode_step(fast, path, route, report)
    except (torch.OutOfMemoryError, MemoryError):  # what its own units need, its disk the file
        skeleton = functools.partial(fast_skeleton, file)
        needed = fast_bytes(file)
        raise out_of_memory(route.name, needed, route.device, skeleton, mapped=True) from None
    except (Unsupported, GGUFError, ValueError, RuntimeError) as error:
        raise ModelLoadError(f"{path} could not be loaded: {short(error)}") from None
    info = describe_fast(fast, route.name, route.source)
    if placed is None:
        return LoadedModel(fast, with_pad(tokenizer), info, compiling)
    info = replace(info, placement=placed.placement)
    return LoadedModel(fast, with_pad(tokenizer), info, compiling, placed.meter)


def _build(
    file: GGUFFile, path: Path, places: DeviceMapDict | None, route: Route, report: Progress
) -> tuple[GGUFLlama, MappedPlacement | None]:
    """The model on the file's weights; placed by `places`, its disk-placed layers compute
    from the mapped file (engine/placement/mapped.py)."""
    layers = range(read_shape(file).layers)
    on_disk = frozenset(i for i in layers if places and places[f"model.layers.{i}"] == "disk")
    packed = pack_path(route.cache / "packed", path.stem, file_key(path))
    packs = PackCache(packed, path.stem)
    progress = per_tensor(report, "Loading the 4-bit weights", 0.3, 0.97)
    if places is None and route.device.type != "cpu" and not int4_wanted(route.device):
        # the file's blocks as they are: to_device dequantises them on the device
        return build_fast(file, progress, kernels=False, device_blocks=True), None
    kernels = route.device.type == "cpu"
    fast = build_fast(file, progress, packs, kernels=kernels, mapped_layers=on_disk)
    if on_disk and packs.missed:  # its repacks were just made, in memory: map them instead
        del fast
        release_freed_memory()
        fast = build_fast(file, None, PackCache(packed, path.stem), mapped_layers=on_disk)
    if places is None:
        return fast, None
    report("Placing the layers", 0.97)
    return fast, place_fast(fast, places, placement_note(route.request))


def place_fast(model: GGUFLlama, mapping: DeviceMapDict, note: str) -> MappedPlacement:
    """Place the fast model's layers and head as `mapping` says (built with its disk-placed
    layers on the mapped file); with any on disk, its decode step stays eager, so each one's
    reading in is timed before it runs."""
    units = [(f"model.layers.{i}", block) for i, block in enumerate(model.blocks)]
    units.append(("lm_head", model.output.bulk))  # its exact rows: a few looked up a step
    placed = place_mapped(model, units, mapping, note)
    if placed.meter is not None:
        model.compile_refusal = (
            "layers placed on disk are read in one by one before they run, which the"
            " compiled step (one function for every layer) cannot stop for"
        )
    return placed


def _decode_step(
    model: GGUFLlama, path: Path, route: Route, report: Progress
) -> Attacher | StepState | None:
    """The CPU's compiled step on its way, or the GPU form of the weights with its static
    step (engine/step/static.py)."""
    if route.device.type == "cpu":
        return compile_in_background(model, path, route.cache, route.request)
    kernels = route.cache / "cuda-kernels"
    began = time.perf_counter()
    model = to_device(model, route.device)
    log.info("weights in their %s form in %.1f s", route.device, time.perf_counter() - began)
    return static_decode.attach(model, kernels=kernels, report=report)


def compile_in_background(
    model: GGUFLlama, path: Path, cache: Path, request: LoadRequest
) -> Attacher | None:
    """Start attaching the compiled decode step (compiling it first if it is not kept and the
    request builds one)."""
    if not request.compiled:
        return None
    # the model's own refusal first (layers placed on disk), then the step's and the user's
    reason = model.compile_refusal or compiled_decode.refusal(model) or compiled_decode.disabled()
    if reason is not None:
        log.info("the decode step stays eager: %s", reason)
        return None
    threads = torch.get_num_threads()
    folder = cache / "compiled"
    artifact = compiled_decode.artifact_path(folder, path.stem, file_key(path), threads, model)
    if not (artifact.exists() or request.build_compiled):
        log.info("the decode step stays eager: none is kept for %d threads", threads)
        return None
    return Attacher(model, path, artifact, cache).start()
