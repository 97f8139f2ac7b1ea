"""The fast model's decode step compiled ahead of time: one C++ function for every layer.

Eager, a decode step of the bundled model is its int4 kernels and ~1,000 small ops, each
paying Python's and torch's dispatch. AOTInductor (torch.export, then inductor's C++ code in a
shared library) runs the same ops as one function with the pointwise ones fused, at a much
smaller CPU cost a step.

Compiling takes minutes on a small machine, so it happens once per model
file, torch version, CPU, thread count and STEP_VERSION of the step's code, in a background
process at low priority (`python -m engine.load.compile_step`, one build of a package at a time:
engine/disk/build_lock.py), and is kept in the cache folder as a .pt2 package. Until it is there
the model decodes eagerly; then a background thread loads it through torch's C++ package
loader (quickly, and with no dynamo or inductor import, where loading a torch.compile'd
function takes seconds and far more memory) and the next step goes through it.

The function is engine/model/layer.py's `decode_layer`, the eager forward's own layer, with
ops over flat tensors (`decode_layers`): the weights' kernels named by a static plan, the
cache written at positions carried as tensor sizes. Every architecture of the fast model
(Gemma 3's sliding window and norms included) goes through it.

Only one-token passes through a cache are compiled; the prompt's pass and the no-cache
teaching mode stay eager. The probes stay the model's own: the function returns every layer's
queries and writes its keys into the cache, so a watched layer's attention is computed from
the q and k it attended with; and it returns every layer's output, which a watched logit lens
keeps (engine/model/lens.py), so the lens needs no eager pass.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import threading
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.disk import build_lock
from engine.model.kv_buffer import KVBuffer
from engine.model.layer import Rope
from engine.model.llama import GGUFLlama, StepOutputs
from engine.step.flat import (
    LayerPlan,
    LayerTensors,
    decode_layers,
    kinds_refusal,
    layer_plan,
    layer_weights,
    layers_refusal,
    step_positions,
    window_of,
)

__all__ = ["LayerPlan", "decode_layers", "layer_plan", "layer_weights"]  # used beside the step

log = logging.getLogger(__name__)


class Runner(Protocol):
    """torch._C._aoti.AOTIModelPackageLoader: the package's function on flat tensor lists."""

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...


def refusal(model: GGUFLlama) -> str | None:
    """Why this model's decode step cannot be compiled here, or None if it can."""
    if model.device.type != "cpu":
        return f"the compiled step runs on the CPU, not on {model.device.type}"
    if _package_loader() is None:
        return f"torch {torch.__version__} is older than the {MIN_TORCH} the step is built for"
    return layers_refusal(model, "compiled step") or kinds_refusal(model)


# torch 2.11's package loader crashed (a segmentation fault) on a package it had just built
# here; 2.13 is the version the step is built and tested with.
MIN_TORCH = "2.13"

# The version of the step's code, in the name of every package built: bump it whenever what
# the package computes or takes changes (engine/model/layer.py, engine/step/flat.py, the
# inputs CompiledDecode passes), so that no run loads a package of older code.
# tests/engine/step/test_compiled.py pins it to a hash of that code.
STEP_VERSION = 4


def _package_loader() -> Any:
    """AOTInductor's C++ package loader, or None in a torch without it or older than
    MIN_TORCH (the one check of the version: refusing, building and loading all ask here)."""
    if torch.__version__ < MIN_TORCH:
        return None
    aoti = getattr(torch._C, "_aoti", None)
    return getattr(aoti, "AOTIModelPackageLoader", None)


def can_save_compiled() -> bool:
    """Whether this torch can compile and package the step (imports inductor: seconds, for the
    compiling process and the tests; where it cannot, a load's background compile says so)."""
    import torch._inductor

    return _package_loader() is not None and hasattr(torch._inductor, "aoti_compile_and_package")


def disabled() -> str | None:
    """Why compiling is turned off ($GLASSBOX_COMPILE=0), or None."""
    return "$GLASSBOX_COMPILE is 0" if os.environ.get("GLASSBOX_COMPILE") == "0" else None


# decode_layers' inputs: x, ropes, positions, eps, weights per layer, keys, values
StepInputs = tuple[
    torch.Tensor,
    tuple[tuple[torch.Tensor, ...], ...],
    tuple[torch.Tensor, ...],
    torch.Tensor,
    list[LayerTensors],
    list[torch.Tensor],
    list[torch.Tensor],
]


class CompiledDecode:
    """The loaded compiled function with the model's weights, called like llama's layers."""

    def __init__(self, runner: Runner, model: GGUFLlama) -> None:
        self.runner = runner
        self.weights = layer_weights(model)
        self.flat_weights = [t for layer in self.weights for t in layer]
        self.eps = torch.full((1, 1), model.shape.eps)
        self.window = window_of(layer_plan(model))

    def __call__(
        self, x: torch.Tensor, ropes: tuple[Rope, ...], start: int, cache: KVBuffer
    ) -> StepOutputs:
        rope_tensors = tuple(rope.tensors() for rope in ropes)
        positions = step_positions(start, cache, self.window)
        inputs = (x, rope_tensors, positions, self.eps, self.weights, cache.keys, cache.values)
        return self.run(inputs)

    def run(self, inputs: StepInputs) -> StepOutputs:
        """decode_layers(*inputs) through the package, its inputs flattened as torch.export
        flattened them: depth first."""
        x, ropes, positions, eps, _, keys, values = inputs
        flat = [x, *(t for rope in ropes for t in rope), *positions, eps, *self.flat_weights]
        x, *queries, residuals = self.runner.run([*flat, *keys, *values])
        return x, queries, residuals


class _DecodeLayers(torch.nn.Module):
    """decode_layers as the module torch.export traces, with the model's plan fixed."""

    def __init__(self, plan: Sequence[LayerPlan]) -> None:
        super().__init__()
        self.step = functools.partial(decode_layers, plan=plan)

    def forward(self, *inputs: Any) -> StepOutputs:
        """decode_layers' inputs but the plan, in its order."""
        return self.step(*inputs)


# -- where it is kept, how it is built and loaded -------------------------------------------


def artifact_path(folder: Path, stem: str, file_key: str, threads: int, model: GGUFLlama) -> Path:
    """Where the compiled step of a GGUF is kept: named by the file, torch, the CPU's vector
    instructions, the model's layer plan (which kernel holds each weight: the step takes
    those tensors and no others), the thread count (the compiled loops are built for it) and
    STEP_VERSION (a changed step must not load an older one)."""
    version = torch.__version__.replace("+", "-")
    isa = torch.backends.cpu.get_cpu_capability().lower()
    plan = hashlib.sha256(repr(layer_plan(model)).encode()).hexdigest()[:8]
    return folder / f"{stem}-{file_key}-torch{version}-{isa}-{plan}-{threads}t-v{STEP_VERSION}.pt2"


@contextlib.contextmanager
def _scratch_beside(path: Path) -> Iterator[Path]:
    """A scratch folder next to `path` for the package and inductor's own kernel cache: the
    package holds all it needs, so nothing else is kept (the kernels took ~150 MB)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(path.parent / "inductor", ignore_errors=True)  # kept by earlier versions
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    scratch = build_lock.partial_folder(path)  # named by this process: swept if it is killed
    scratch.mkdir(exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(scratch / "inductor")
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        if before is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def compile_to(model: GGUFLlama, path: Path) -> None:
    """Compile the model's decode step and save it at `path` (2-3 minutes on 2 cores)."""
    import torch._inductor

    with torch.no_grad():
        module = _DecodeLayers(layer_plan(model))
        inputs, dynamic = _example(model)
        # forward(*inputs): export binds them as one argument, so the shapes are nested once
        exported = torch.export.export(module, inputs, dynamic_shapes=(dynamic,))
    with _scratch_beside(path) as scratch:
        partial = scratch / "step.pt2"  # whole, then renamed: a load never sees half of one
        torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
        partial.replace(path)
    remove_stale(path)


def _example(model: GGUFLlama) -> tuple[StepInputs, tuple[Any, ...]]:
    """Inputs to trace decode_layers with, and which of their sizes vary: example sizes that
    differ from each other, so that export takes none of them for another."""
    from torch.export import Dim

    cache = model.new_cache()
    cache.reserve(64)
    x = torch.zeros(1, model.shape.dim)
    ropes = tuple(rope.tensors() for rope in model.ropes(2, 1))
    eps = torch.full((1, 1), model.shape.eps)
    weights = layer_weights(model)
    window = window_of(layer_plan(model))
    # a one-token pass after at least one cached position; on sliding layers its slot and the
    # first slot it sees (+ 2), as step_positions passes them
    positions: tuple[torch.Tensor, ...] = (torch.empty(3, 0),)
    sizes: tuple[dict[int, Any], ...] = ({0: Dim("positions", min=2)},)
    if window:
        positions += (torch.empty(5, 0), torch.empty(4, 0))
        sizes += ({0: Dim("slot", min=2)}, {0: Dim("first", min=2)})
    # the cache grows by chunks, keeping one position free; sliding layers' room apart
    capacity, room = Dim("capacity", min=3), Dim("room", min=3)
    sliding = set(model.shape.sliding_layers) if window else set()
    cache_sizes = [{2: room if i in sliding else capacity} for i in range(len(cache.keys))]
    inputs = (x, ropes, positions, eps, weights, cache.keys, cache.values)
    dynamic = (None, tuple((None,) * len(r) for r in ropes), sizes, None,
               [(None,) * len(w) for w in weights], cache_sizes, cache_sizes)  # fmt: skip
    return inputs, dynamic


def remove_stale(path: Path) -> None:
    """Delete the steps of the same file that no run can load any more: those of another
    torch version or of older code (other thread counts stay: another command uses them),
    with their unpacked files, and the files unpacked from `path` before it was saved anew."""
    file_part, _, rest = path.name.partition("-torch")
    version = rest.split("-", 1)[0]
    code = path.stem.rsplit("-", 1)[-1]

    def kept(package: Path) -> bool:
        current = package.name.startswith(f"{file_part}-torch{version}-")
        return package == path or (current and package.name.endswith(f"-{code}{path.suffix}"))

    for other in path.parent.glob(f"{file_part}-torch*"):
        if other.is_dir():  # unpacked files, or a build's partial output (build_lock.sweep's)
            package = other.with_name(other.name.removesuffix(UNPACKED))
            if other.name.endswith(UNPACKED) and (package == path or not kept(package)):
                shutil.rmtree(other, ignore_errors=True)
        elif not kept(other):
            other.unlink(missing_ok=True)


def load(path: Path, model: GGUFLlama) -> CompiledDecode:
    """The compiled step saved at `path`, bound to `model`'s weights."""
    loader = _package_loader()
    if loader is None:
        raise RuntimeError(f"torch {torch.__version__} cannot load the compiled step")
    # Given the package's zip, the loader unpacks it into a temporary folder that only its
    # destructor removes, which an engine process ends without running (the window's quit
    # stops it): each run left the step's files in the system's temporary folder. Loaded
    # from a folder, the loader unpacks nothing and removes nothing.
    # (package, model name, run single-threaded, runners, device index: -1 is the CPU)
    return CompiledDecode(loader(str(unpacked(path)), "model", False, 1, -1), model)


UNPACKED = ".unpacked"  # beside a package: its files, as the loader reads them


def unpacked(path: Path) -> Path:
    """The package at `path` unpacked into a folder beside it, once (whole, then renamed: a
    load never sees half of one). remove_stale removes it with the package it came from."""
    folder = path.with_name(path.name + UNPACKED)
    if folder.is_dir():
        return folder
    partial = build_lock.partial_folder(folder)  # named by this process: swept if it is killed
    try:
        with zipfile.ZipFile(path) as package:
            package.extractall(partial)
        partial.rename(folder)
    except zipfile.BadZipFile as error:
        raise RuntimeError(f"{path.name} is not a step package (a zip): {error}") from error
    except OSError:
        if not folder.is_dir():  # else another process unpacked it first
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


NOT_COMPILED = "eager: not compiled (turned off or not supported)"  # a load without an Attacher


class Attacher:
    """Gives a fast model its compiled step in the background: loads it if it is kept, else
    compiles it in a process of its own at low priority first. `done` is set either way."""

    def __init__(self, model: GGUFLlama, gguf: Path, path: Path, cache_dir: Path) -> None:
        self.model, self.gguf, self.path, self.cache_dir = model, gguf, path, cache_dir
        self.done = threading.Event()
        # set while a build process compiles the step beside this one (ChatSession decodes
        # with a thread fewer meanwhile)
        self.building = threading.Event()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="compiled-decode", daemon=True)

    def start(self) -> Attacher:
        self.thread.start()
        return self

    @property
    def state(self) -> str:
        """Once `done`: "compiled", or "eager: why"."""
        return "compiled" if self.error is None else f"eager: {self.error}"

    def _run(self) -> None:
        try:
            self._compile_elsewhere()
            with torch.no_grad():
                self.model.decode_step = load(self.path, self.model)
            log.info("decode step compiled and attached (%s)", self.path.name)
        except Exception as error:  # the eager step keeps working: say why, once
            self.error = f"{type(error).__name__}: {error}"
            log.warning("the decode step stays eager: %s", self.error)
        finally:
            self.done.set()

    def _compile_elsewhere(self) -> None:
        """Compile the step unless it is kept or another launch's build makes it."""
        files = (str(self.gguf), str(self.path), str(self.cache_dir))
        threads = f"--threads={torch.get_num_threads()}"  # the count this process decodes with
        command = [*LOW_PRIORITY, sys.executable, "-m", BUILDER, *files, threads]
        root = Path(__file__).parents[2]  # where `engine` imports from
        if not self.path.exists():
            self.building.set()
        try:
            result = build_lock.build_once(self.path, command, cwd=root)
        finally:
            self.building.clear()
        if result is not None and result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"compiling exited with code {result.returncode}: {last}")


# A background compile must not slow the replies decoded meanwhile: it gets the idle CPU.
LOW_PRIORITY = ["nice", "-n", "19"] if shutil.which("nice") else []
BUILDER = "engine.load.compile_step"  # the module that compiles it (python -m)
