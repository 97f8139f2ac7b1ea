"""From the user's placement to accelerate's device map, or a one-line refusal before loading.

A model is cut into the units accelerate moves whole: the decoder layers, and the modules
around them (embedding, final norm, head). `auto`, `balanced` and `sequential` go through
accelerate's `infer_auto_device_map` over per-device budgets: the user's caps, else what is
free now less some headroom (the KV cache, activations and the rest of the process need
room too). On a CUDA load every visible GPU gets a budget, the main one first, so `auto`
fills them in turn and `balanced` evens the layers out between them, as accelerate does.
`gpu-layers=N` is the layer-to-device dict itself, on the main GPU. Whatever does not fit in
RAM goes to "disk": memory-mapped files that accelerate's hooks read in before each use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

from engine.device_map import (
    DeviceMap,
    PlacementError,
    Proposal,
    format_bytes,
    parse_max_memory,
)

# What "auto" leaves free: a tenth of the GPU's free memory, and a fifth of the RAM available
# plus 1 GiB (the process itself, the tokenizer, the window's copy of the panels' data).
GPU_KEEP = 0.10
RAM_KEEP = 0.20
RAM_KEEP_BYTES = 1 << 30

DeviceMapDict = dict[str, str]


@dataclass(frozen=True, slots=True)
class Unit:
    """A piece of the model that is placed, moved and run whole."""

    name: str  # module path, e.g. "model.layers.3"
    bytes: int
    layer: int | None  # the decoder layer's index, None for the modules around the layers


def units(model: torch.nn.Module) -> list[Unit]:
    """The model's units in the order a pass runs them; a tied weight counts once, with the
    first unit that holds it (the embedding, not the head)."""
    stack, stack_name = _decoder_layers(model)
    parent_name = stack_name.rpartition(".")[0]
    parent = model.get_submodule(parent_name) if parent_name else model
    seen: set[int] = set()
    found: list[Unit] = []

    def add(name: str, module: torch.nn.Module, layer: int | None) -> None:
        size = 0
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                size += tensor.numel() * tensor.element_size()
        found.append(Unit(name, size, layer))

    prefix = f"{parent_name}." if parent_name else ""
    for name, child in parent.named_children():
        if child is stack:
            for index, layer in enumerate(stack):
                add(f"{stack_name}.{index}", layer, index)
        else:
            add(prefix + name, child, None)
    if parent is not model:
        for name, child in model.named_children():
            if child is not parent:
                add(name, child, None)
    return found


def _decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.ModuleList, str]:
    """The model's stack of decoder layers: its longest ModuleList."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    if not lists:
        raise PlacementError(f"{type(model).__name__} has no list of layers to place")
    name, stack = max(lists, key=lambda pair: len(pair[1]))
    return stack, name


def free_memory(device: str) -> int:
    """Bytes free now on `device` ("cpu", "cuda:N"; for MPS the RAM, which it shares)."""
    if device.startswith("cuda"):
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    return int(psutil.virtual_memory().available)


def gpus(main: torch.device) -> list[str]:
    """The CUDA devices a load on `main` may place layers on: the main one, then the others."""
    if main.type != "cuda":
        return []
    first = f"cuda:{main.index or 0}"
    return [first] + [f"cuda:{i}" for i in range(torch.cuda.device_count()) if f"cuda:{i}" != first]


def budgets(main: torch.device, caps: dict[str, int]) -> dict[str, int]:
    """Bytes each device may hold: the user's cap, else what is free less the headroom."""
    places = [*gpus(main), "cpu"]
    result: dict[str, int] = {}
    for place in places:
        if place in caps:
            result[place] = caps[place]
        elif place == "cpu":
            result[place] = max(int(free_memory(place) * (1 - RAM_KEEP)) - RAM_KEEP_BYTES, 0)
        else:
            result[place] = int(free_memory(place) * (1 - GPU_KEEP))
    unknown = set(caps) - set(result)
    if unknown:
        raise PlacementError(
            f"--max-memory names {', '.join(sorted(unknown))}, which this load does not use"
            f" (the model runs on {main}; caps apply to {' and '.join(result)})"
        )
    return result


def check_caps(found: list[Unit], limits: dict[str, int]) -> None:
    """Refuse a cap smaller than the largest unit: accelerate brings an offloaded unit in
    whole before it runs, so a device that executes must hold at least one."""
    largest = max(found, key=lambda unit: unit.bytes)
    for place, limit in limits.items():
        if limit < largest.bytes:
            raise PlacementError(
                f"a cap of {format_bytes(limit)} on {place} cannot work: {largest.name}"
                f" ({format_bytes(largest.bytes)}) must fit there whole while it runs;"
                f" give {place} at least {format_bytes(largest.bytes * 1.05)}"
            )


def device_map(
    model: torch.nn.Module, choice: DeviceMap, max_memory: str, main: torch.device
) -> DeviceMapDict:
    """The module-to-place map for `choice` on a model whose weights need not be loaded (a
    meta-device skeleton will do): places are "cuda:N", "cpu" or "disk"."""
    found = units(model)
    if choice.strategy == "gpu-layers":
        _check_gpu_layers(found, choice.gpu_layers, main)
    limits = budgets(main, parse_max_memory(max_memory))
    if choice.strategy == "gpu-layers":
        return _gpu_layers(found, choice.gpu_layers, main, limits)
    check_caps(found, limits)
    planned = _accelerate_map(model, choice.strategy or "auto", limits, main)
    # per unit: accelerate may name a whole subtree ("": "disk"), which its dispatch misreads
    return {unit.name: place_of(unit.name, planned) for unit in found}


def _accelerate_map(
    model: torch.nn.Module, strategy: str, limits: dict[str, int], main: torch.device
) -> DeviceMapDict:
    from accelerate import infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    memory: dict[int | str, int] = {_accelerate_key(k): v for k, v in limits.items()}
    no_split = list(getattr(model, "_no_split_modules", None) or ())
    if strategy == "balanced" and main.type == "cuda":
        memory = get_balanced_memory(model, memory, no_split_module_classes=no_split)
    planned = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=no_split)
    return {name: _place_name(place) for name, place in planned.items()}


def _gpu_layers(
    found: list[Unit], count: int, main: torch.device, limits: dict[str, int]
) -> DeviceMapDict:
    """The first `count` decoder layers and the modules around them on the GPU; the other
    layers in RAM up to its budget, then on disk."""
    gpu = f"cuda:{main.index or 0}" if main.type == "cuda" else "cpu"
    ram_left = limits.get("cpu", 0)
    result: DeviceMapDict = {}
    for unit in found:
        if unit.layer is None or unit.layer < count:
            result[unit.name] = gpu
        elif unit.bytes <= ram_left:
            result[unit.name] = "cpu"
            ram_left -= unit.bytes
        else:
            result[unit.name] = "disk"
    if gpu != "cpu":
        needed = sum(unit.bytes for unit in found if result[unit.name] == gpu)
        if needed > limits[gpu]:
            raise PlacementError(
                f"gpu-layers={count} needs {format_bytes(needed)} on {gpu}, which has"
                f" {format_bytes(limits[gpu])} to give; try --device-map auto"
            )
    return result


def _check_gpu_layers(found: list[Unit], count: int, main: torch.device) -> None:
    layers = sum(unit.layer is not None for unit in found)
    if main.type != "cuda" and count > 0:
        raise PlacementError(f"gpu-layers={count} needs a CUDA device; this load runs on {main}")
    if count > layers:
        raise PlacementError(f"gpu-layers={count}: this model has {layers} layers")


def _accelerate_key(place: str) -> int | str:
    return int(place.partition(":")[2] or 0) if place.startswith("cuda") else place


def _place_name(place: int | str | torch.device) -> str:
    if isinstance(place, int):
        return f"cuda:{place}"
    return str(place)


def place_of(name: str, mapping: DeviceMapDict) -> str:
    """Where module `name` lives under `mapping` (its longest mapped prefix)."""
    while True:
        if name in mapping:
            return mapping[name]
        if not name:
            raise KeyError(name)
        name = name.rpartition(".")[0]


def fit_proposal(
    name: str,
    needed: int,
    main: torch.device,
    layers: int = 0,
    skeleton: Callable[[], torch.nn.Module] | None = None,
    mapped: bool = False,
) -> Proposal | None:
    """None when `needed` bytes fit on `main` now; else how much is missing and the placement
    that would fit. With `skeleton` (made only when needed: the model's shapes), a RAM cap is
    planned as a load with it would be, so the bytes it says go to disk are the plan's, and a
    cap that cannot work (below the largest unit) proposes nothing (device_map ""). `mapped`:
    the fast model's disk is its mapped file, read back only where the OS dropped it."""
    place = "cpu" if main.type != "cuda" else f"cuda:{main.index or 0}"
    free = free_memory(place)
    if needed <= free:
        return None
    short = (
        f"{name} needs {format_bytes(needed)} on {place} but only {format_bytes(free)} is"
        f" free: {format_bytes(needed - free)} missing."
    )
    if place == "cpu":
        # What "auto" would leave free; on a small machine, half of what is free (the other
        # half to run in).
        cap = int(free * (1 - RAM_KEEP)) - RAM_KEEP_BYTES
        cap = cap if cap > 0 else free // 2
        device_map, max_memory = "auto", f"cpu={cap >> 20}MiB"
        try:
            disk = needed - cap if skeleton is None else _disk_bytes(skeleton(), max_memory, main)
        except PlacementError as error:
            line = f"{short} Placed, it would not run either: {error}."
            return Proposal(f"{line} Free some memory or choose a smaller model.", "", "")
        cost = f"{format_bytes(disk)} of weights read from disk on every token"
        if mapped:
            cost = (
                f"{format_bytes(disk)} of layers left in the mapped file, read from disk where"
                " the OS has dropped them"
            )
    else:
        per_layer = needed / max(layers, 1)
        fitting = max(min(int(free * (1 - GPU_KEEP) / per_layer) - 1, layers), 0)
        device_map, max_memory = f"gpu-layers={fitting}", ""
        cost = "the other layers in RAM, then on disk"
    fix = f"--device-map {device_map}" + (f" --max-memory {max_memory}" if max_memory else "")
    return Proposal(f"{short} It would fit as {fix} ({cost}).", device_map, max_memory)


def _disk_bytes(skeleton: torch.nn.Module, max_memory: str, main: torch.device) -> int:
    """The bytes `auto` under `max_memory` puts on disk (accelerate keeps room in RAM for the
    largest unit it brings in, so this can be more than what exceeds the cap)."""
    mapping = device_map(skeleton, DeviceMap("auto"), max_memory, main)
    return sum(unit.bytes for unit in units(skeleton) if mapping[unit.name] == "disk")
