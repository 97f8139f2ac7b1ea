"""What every placed route shares (a request with --device-map or --max-memory): the device map
planned on the model's skeleton before anything is read, the placement's note, and the loaded
model's description with where its layers are. Each route places its own way: the fast model
computes its disk-placed layers from the mapped file (engine/load/gguf_fast.py), a dequantised
GGUF writes them to disk as it goes (engine/load/gguf_exact.py), transformers streams a folder's
weights to their places (engine/load/pretrained.py), and a model already in memory is `place`d."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from engine.device_map import PlacementError, parse_device_map
from engine.load.loaded import LoadedModel, ModelLoadError
from engine.placement import plan as placement_plan
from engine.placement.dispatch import Placed, place_in_memory
from engine.placement.plan import DeviceMapDict
from engine.settings import LoadRequest


def plan(skeleton: torch.nn.Module, request: LoadRequest, device: torch.device) -> DeviceMapDict:
    """The request's device map over `skeleton` (the model's shapes), or the refusal."""
    try:
        choice = parse_device_map(request.device_map)
        return placement_plan.device_map(skeleton, choice, request.max_memory, device)
    except PlacementError as error:
        raise ModelLoadError(f"Placement refused: {error}.") from None


def placement_note(request: LoadRequest) -> str:
    """The options the placement was asked with, as the Placement panel shows them."""
    parts = [f"--device-map {request.device_map or 'auto'}"]
    if request.max_memory:
        parts.append(f"--max-memory {request.max_memory}")
    return " ".join(parts)


def with_placement(loaded: LoadedModel, placed: Placed) -> LoadedModel:
    """The loaded model's description with its placement, and the meter of what it moves."""
    where = placed.placement.execution_device  # a disk-placed first weight is on "meta"
    loaded.info = replace(loaded.info, device=where, placement=placed.placement)
    loaded.transfers = placed.meter
    return loaded


def place(
    loaded: LoadedModel, request: LoadRequest, device: torch.device, cache: Path
) -> LoadedModel:
    """Place a loaded transformers model whose weights are in memory as `request` says
    (its device_map and max_memory); disk-placed weights go under `cache`."""
    mapping = plan(loaded.model, request, device)
    placed = place_in_memory(loaded.model, mapping, device, cache, placement_note(request))
    return with_placement(loaded, placed)
