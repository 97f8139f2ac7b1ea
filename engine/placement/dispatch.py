"""Place a transformers model by a device map behind accelerate's hooks, and describe it.

Disk-placed weights go to an offload folder of this process under the cache folder: written
once at load (accelerate's .dat files, memory-mapped back in by its hooks), removed when the
model is collected or the process ends; folders left by dead processes are swept at the next
placed load.
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import weakref
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from engine.device_map import format_bytes
from engine.events import Placement
from engine.placement.plan import DeviceMapDict, Unit, place_of, units
from engine.placement.transfer import PassCost, TransferMeter, probe

log = logging.getLogger(__name__)

OFFLOAD = "offload"
_counter = itertools.count()


@dataclass
class Placed:
    """A placed model's description, and the meter of what its hooks move (None: nothing)."""

    placement: Placement
    meter: TransferMeter | None


def offload_folder(cache: Path) -> Path:
    """A fresh folder for this load's disk-placed weights (older ones of dead processes go)."""
    root = cache / OFFLOAD
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.iterdir():
        pid = stale.name.partition("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    folder = root / f"{os.getpid()}-{next(_counter)}"
    folder.mkdir()
    return folder


def forget_with(model: torch.nn.Module, folder: Path) -> None:
    """Remove `folder` once `model` is collected, or when the process exits."""
    weakref.finalize(model, shutil.rmtree, folder, ignore_errors=True)


def dispatch(
    model: torch.nn.Module, mapping: DeviceMapDict, main: torch.device, folder: Path
) -> None:
    """Place a model whose weights are in memory: disk-placed ones are written to `folder`."""
    from accelerate import dispatch_model

    places: dict[str, str | torch.device] = {
        name: (place if place in ("cpu", "disk") else torch.device(place))
        for name, place in mapping.items()
    }
    # accelerate compares the main device with "cpu" as a string: a torch.device("cpu") would
    # have it treat RAM-placed layers as offloaded and copy them in on every pass.
    execution: str | torch.device = main.type if main.type in ("cpu", "mps") else main
    dispatch_model(model, places, main_device=execution, offload_dir=str(folder))


def describe(
    found: list[Unit], mapping: DeviceMapDict, main: torch.device, probed: PassCost | None,
    note: str,
) -> Placement:  # fmt: skip
    """The Placement event of a placed model; `probed`: a probe pass's cost, whose read
    bandwidth and compute predict each decode step (None: nothing moves)."""
    place = {unit.name: place_of(unit.name, mapping) for unit in found}
    per_place: dict[str, int] = {}
    for unit in found:
        per_place[place[unit.name]] = per_place.get(place[unit.name], 0) + unit.bytes
    moved_places = {"disk"} if main.type == "cpu" else {"disk", "cpu"}
    moved = sum(unit.bytes for unit in found if place[unit.name] in moved_places)
    layers = [unit for unit in found if unit.layer is not None]
    placement = Placement(
        layer_places=tuple(place[unit.name] for unit in layers),
        layer_bytes=tuple(unit.bytes for unit in layers),
        place_bytes=tuple(sorted(per_place.items())),
        moved_bytes=moved,
        read_bytes_per_s=probed.read_bytes_per_s if probed else 0.0,
        execution_device=str(main),
        note=note,
        compute_s=probed.compute_s if probed else 0.0,
    )
    log.info("placement: %s", summary(placement))
    return placement


def summary(placement: Placement) -> str:
    """One line: bytes per place, what each pass moves and at what measured speed."""
    where = ", ".join(f"{format_bytes(b)} {p}" for p, b in placement.place_bytes)
    if not placement.moved_bytes:
        return f"{where}; nothing moves per token"
    if placement.mapped:  # Glassbox's own model: its disk is the mapped file
        return (
            f"{where}; the disk-placed layers compute from the mapped file, read from storage"
            f" (at {format_bytes(placement.read_bytes_per_s)}/s measured) only where the OS"
            " has dropped them"
        )
    return (
        f"{where}; {format_bytes(placement.moved_bytes)} read in per token at"
        f" {format_bytes(placement.read_bytes_per_s)}/s measured"
        f" (~{placement.predicted_transfer_s * 1000:.0f} ms of a"
        f" ~{placement.predicted_step_s * 1000:.0f} ms token)"
    )


class DiskWriter:
    """Writes the weights `mapping` puts on disk into `folder` as they are made (a
    gguf_model.WeightSink), in accelerate's offload format; `close()` writes the index."""

    def __init__(self, mapping: DeviceMapDict, folder: Path) -> None:
        self.mapping, self.folder = mapping, folder
        self.index: dict[str, dict[str, object]] = {}

    def __call__(self, name: str, weight: torch.Tensor) -> bool:
        if place_of(name, self.mapping) != "disk":
            return False
        from accelerate.utils import offload_weight

        offload_weight(weight, name, str(self.folder), index=self.index)
        return True

    def close(self) -> None:
        from accelerate.utils import save_offload_index

        save_offload_index(self.index, str(self.folder))


def place_in_memory(
    model: torch.nn.Module,
    mapping: DeviceMapDict,
    main: torch.device,
    cache: Path,
    note: str,
    written: DiskWriter | None = None,
) -> Placed:
    """Place a model built in memory (a dequantised GGUF) by `mapping`; `written`: its
    disk-placed weights are already in that writer's folder (they were never in RAM)."""
    found = units(model)
    folder = offload_folder(cache) if written is None else written.folder
    forget_with(model, folder)
    dispatch(model, mapping, main, folder)
    return finish(model, found, mapping, main, note)


def finish(
    model: torch.nn.Module, found: list[Unit], mapping: DeviceMapDict, main: torch.device,
    note: str,
) -> Placed:  # fmt: skip
    """Meter a dispatched model's offloading hooks (if any), probe what a pass costs, and
    describe its placement."""
    meter = TransferMeter(model, main)
    if not meter.hooks:  # nothing moves: no meter on the decode path
        return Placed(describe(found, mapping, main, None, note), None)
    return Placed(describe(found, mapping, main, probe(model, meter, main), note), meter)
