"""The fast model's decode step compiled ahead of time: one C++ function for every layer.

Eager, a decode step of the bundled model is ~9 ms of int4 kernels and ~1,000 small ops at a
few µs of dispatch each. AOTInductor (torch.export, then inductor's C++ code in a shared
library) runs the same ops as one function with the pointwise ones fused: measured 21.0 ms of
CPU a step against 36.1 eager here, on one thread.

Compiling takes ~2 minutes on 2 cores (longer under load), so it happens once per model
file, torch version, CPU, thread count and STEP_VERSION of the step's code, in a background
process at low priority (`python -m engine.load.compile_step`, one build of a package at a time:
engine/disk/build_lock.py), and is kept in the cache folder as a .pt2 package. Until it is there
the model decodes eagerly; then a background thread loads it through torch's C++ package
loader (well under a second, and no dynamo or inductor import: ~1 MB, where loading a
torch.compile'd function took 4-7 s and ~130 MB) and the next step goes through it.

The function is engine/model/layer.py's `decode_layer`, the eager forward's own layer, with
ops over flat tensors (`decode_layers`): the weights' kernels named by a static plan, the
cache written at positions carried as tensor sizes. Every architecture of the fast model
(Gemma 3's sliding window and norms included) goes through it.

Only one-token passes through a cache are compiled; the prompt's pass and the no-cache
teaching mode stay eager. The probes stay the model's own: the function returns every layer's
queries and writes its keys into the cache, so a watched layer's attention is computed from
the q and k it attended with.
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
import torch.nn.functional as F

from engine.disk import build_lock
from engine.model.gemma import GemmaAttention, GemmaBlock, GemmaFeedForward
from engine.model.kv_buffer import KVBuffer, WindowedKVBuffer
from engine.model.layer import LayerForm, LayerOps, LayerWeights, decode_layer, rotate
from engine.model.llama import Attention, Block, FeedForward, GGUFLlama, QKNormAttention, Rope
from engine.weights import ggml_kernel
from engine.weights.linear import (
    BLOCK,
    DenseLinear,
    GGMLLinear,
    Int4Linear,
    PartsLinear,
    Q6KLinear,
    interleave_q6,
)

if TYPE_CHECKING:
    from engine.weights.linear import Linear, Part

log = logging.getLogger(__name__)

_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu.default

# One layer's tensors in the step: LayerWeights' that it has, then its linears' parts'
LayerTensors = tuple[torch.Tensor, ...]


class Runner(Protocol):
    """torch._C._aoti.AOTIModelPackageLoader: the package's function on flat tensor lists."""

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...


def refusal(model: GGUFLlama) -> str | None:
    """Why this model's decode step cannot be compiled here, or None if it can."""
    if model.device.type != "cpu":
        return f"the compiled step runs on the CPU, not on {model.device.type}"
    if _package_loader() is None:
        return f"torch {torch.__version__} is older than the {MIN_TORCH} the step is built for"
    return layers_refusal(model, "compiled step") or _kinds_refusal(model)


def layers_refusal(model: GGUFLlama, step: str) -> str | None:
    """Why a fast step (`step` names it) cannot run this model's layers: one whose block,
    attention or feed-forward is a class layer.decode_layer was not written for."""
    for block in _blocks(model):
        if type(block) not in BLOCKS:
            return f"its {type(block).__name__} layers are not in the {step}"
        for part in (block.attention, block.feed_forward):
            if type(part) not in PARTS:
                return f"its {type(part).__name__} is not in the {step}"
    return None


# The classes whose layers layer.decode_layer runs, every field of theirs in LayerWeights,
# LayerForm or a step's ops: a subclass may add what none of them has.
BLOCKS = (Block, GemmaBlock)
PARTS = (Attention, QKNormAttention, GemmaAttention, FeedForward, GemmaFeedForward)


def _kinds_refusal(model: GGUFLlama) -> str | None:
    for block in _blocks(model):
        for linear in block.linears():
            if any(_kind(part) is None for part in _parts(linear)):
                return f"its {type(linear).__name__} weights are not in the compiled step"
    return None


# torch 2.11's package loader crashed (a segmentation fault) on a package it had just built
# here; 2.13 is the version the step is built and tested with.
MIN_TORCH = "2.13"

# The version of the step's code, in the name of every package built: bump it whenever what
# the package computes or takes changes (engine/model/layer.py, decode_layers and its helpers,
# the inputs CompiledDecode passes, layer_plan and layer_weights), so that no run loads a
# package of older code. tests/engine/step/test_compiled.py pins it to a hash of that code.
STEP_VERSION = 3


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


def _blocks(model: GGUFLlama) -> list[Block]:
    return cast("list[Block]", list(model.blocks))


# How one product of a layer runs in the compiled step, and how many tensors it takes; a
# GGML kernel's kind names its type ("ggml 12"), and takes the raw blocks alone.
INT4, INT4_HALVES, INT4_Q6, BF16, GGML = "int4", "int4 halves", "int4 per 16", "bf16", "ggml"
TENSORS = {INT4: 2, INT4_HALVES: 2, INT4_Q6: 2, BF16: 1}


@dataclass(frozen=True)
class LayerPlan:
    """The static shape of one layer in the step: its form, which of LayerWeights' tensors it
    has (in their order), for qkv, out, gate_up and down the kind of each of their parts (a
    part per layout), and how it attends."""

    linears: tuple[tuple[str, ...], ...]
    form: LayerForm
    weights: tuple[str, ...] = ("attention_norm", "ffn_norm")
    attention_kernel: bool = False  # the GGML kernels' attend_one, not inductor's loops
    rope: int = 0  # which of the pass's rotations (Block.rope)
    window: int = 0  # keys a query sees on a sliding layer; 0: every key
    scale: float | None = None  # q·k scale; None: head_dim ** -0.5

    @property
    def bias(self) -> bool:  # Qwen2's q/k/v biases
        return "bias" in self.weights

    @property
    def qk_norm(self) -> bool:  # Qwen3's and Gemma 3's
        return "qk_norm" in self.weights


def _parts(linear: Linear) -> list[Part]:
    return linear.linears() if isinstance(linear, PartsLinear) else [linear]


def _kind(part: Part) -> str | None:
    if isinstance(part, GGMLLinear):
        return f"{GGML} {part.qtype}"
    if isinstance(part, Int4Linear):
        return INT4 if part.plain else INT4_HALVES
    if isinstance(part, Q6KLinear):
        return INT4_Q6
    if isinstance(part, DenseLinear) and part.weight.dtype == torch.bfloat16:
        return BF16
    return None


def _tensors(part: Part) -> tuple[torch.Tensor, ...]:
    if isinstance(part, GGMLLinear):
        return (part.raw,)
    if isinstance(part, Int4Linear | Q6KLinear):
        return part.packed, part.scales_zeros
    assert isinstance(part, DenseLinear)  # refusal() allowed no other kind
    return (part.weight,)


def layer_plan(model: GGUFLlama) -> tuple[LayerPlan, ...]:
    """Each layer's plan (refusal() has checked that every part has a kind)."""
    return tuple(
        LayerPlan(
            linears=tuple(
                tuple(cast("str", _kind(part)) for part in _parts(linear))
                for linear in block.linears()
            ),
            form=block.form,
            weights=tuple(name for name, t in block.weights()._asdict().items() if t is not None),
            attention_kernel=ggml_kernel.in_use(),
            rope=block.rope,
            window=block.attention.window or 0,
            scale=block.attention.scale,
        )
        for block in _blocks(model)
    )


def layer_weights(model: GGUFLlama) -> list[LayerTensors]:
    """Per layer: LayerWeights' tensors that it has, then each part's tensors (plan order)."""
    weights = []
    for block in _blocks(model):
        held = tuple(t for t in block.weights() if t is not None)
        tensors = [t for linear in block.linears() for p in _parts(linear) for t in _tensors(p)]
        weights.append((*held, *tensors))
    return weights


def disabled() -> str | None:
    """Why compiling is turned off ($GLASSBOX_COMPILE=0), or None."""
    return "$GLASSBOX_COMPILE is 0" if os.environ.get("GLASSBOX_COMPILE") == "0" else None


def decode_layers(
    x: torch.Tensor,
    ropes: Sequence[Sequence[torch.Tensor]],
    positions: Sequence[torch.Tensor],
    eps: torch.Tensor,
    weights: Sequence[LayerTensors],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    plan: Sequence[LayerPlan],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer of a one-token pass: layer.decode_layer with the step's ops over flat tensors.

    x [1, dim] float32; ropes: per RoPE base, what layer.rotate takes (llama.Rope.tensors);
    positions: tensors [P, 0] whose lengths are sizes, so that each is one dynamic size and not
    a constant of the graph (`step_positions`); eps [1, 1]; weights per layer as layer_weights
    gives them; keys/values [1, kv_heads, capacity, d] per layer. Returns x after the last
    layer and each layer's queries [1, heads, 1, d].
    """
    queries = []
    for layer, tensors in enumerate(weights):
        p = plan[layer]
        held = len(p.weights)
        slot, first = _slots(positions, p.window)
        ops = LayerOps(
            multiply=functools.partial(_multiply, p.linears, _per_linear(p, tensors[held:])),
            rotate=functools.partial(rotate, rope=ropes[p.rope]),
            write=functools.partial(_write, keys[layer], values[layer], slot, first),
            attend=functools.partial(_attend, p),
        )
        named = LayerWeights(**dict(zip(p.weights, tensors[:held], strict=True)))
        x, q = decode_layer(x, named, p.form, eps, ops)
        queries.append(q)
    return x, queries


def step_positions(start: int, cache: KVBuffer, window: int) -> tuple[torch.Tensor, ...]:
    """decode_layers' positions for the token at `start`: [start + 1, 0] (the keys after it is
    written); with sliding layers also the slot it is written to there [slot + 1, 0] (a
    WindowedKVBuffer's sliding layers start at its offset) and the first slot their query
    sees [first + 2, 0] (+ 2: a size of 0 or 1 would be taken for a constant)."""
    filled = torch.empty(start + 1, 0)
    if not window:
        return (filled,)
    slot = start - (cache.offset if isinstance(cache, WindowedKVBuffer) else 0)
    first = max(0, slot - (window - 1))
    return filled, torch.empty(slot + 1, 0), torch.empty(first + 2, 0)


def _slots(positions: Sequence[torch.Tensor], window: int) -> tuple[int, int]:
    """(the cache slot the new key goes to, the first slot its query sees) on a layer."""
    if not window:
        return positions[0].shape[0] - 1, 0
    return positions[1].shape[0] - 1, positions[2].shape[0] - 2


def _write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot: int,
    first: int,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new key and value into their slot; the slots the query sees."""
    k_cache[:, :, slot : slot + 1] = k
    v_cache[:, :, slot : slot + 1] = v
    return k_cache[:, :, first : slot + 1], v_cache[:, :, first : slot + 1]


def _attend(plan: LayerPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [1, h, 1, d] over k, v [1, kv_h, T, d]: the GGML kernel or inductor's loops."""
    heads, kv_heads, d = plan.form.heads, plan.form.kv_heads, plan.form.head_dim
    grouped = q.view(kv_heads, heads // kv_heads, d)  # the query heads of a key head together
    scale = d**-0.5 if plan.scale is None else plan.scale
    if plan.attention_kernel:  # it scales by d ** -0.5: another scale goes into q first
        if scale != d**-0.5:
            grouped = grouped.float() * (scale * d**0.5)
        y: torch.Tensor = torch.ops.glassbox.attend_one(grouped, k[0], v[0])
    else:
        y = _attend_one(grouped, k[0], v[0], scale)
    return y.view(1, heads, 1, d)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per head over the cache, as products and sums inductor fuses into loops that
    read the bf16 keys and values as they are (SDPA on float32 copies read them three times,
    and the copies outgrow the CPU's caches at long contexts: at 5,000 keys the bundled
    model's step took 35.7 ms eagerly, 20-25 ms so). q [kv_h, g, d] (the g query heads of a
    key head), k and v [kv_h, T, d] -> [kv_h, g, d] float32."""
    scores = (q.float()[:, :, None, :] * k.float()[:, None]).sum(-1).mul(scale)
    weights = scores.softmax(-1)  # [kv_h, g, T]
    return (weights[..., None] * v.float()[:, None]).sum(-2)


def _per_linear(plan: LayerPlan, tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors of qkv, out, gate_up and down, each linear's in a list of its own."""
    out, at = [], 0
    for kinds in plan.linears:
        count = sum(1 if kind.startswith(GGML) else TENSORS[kind] for kind in kinds)
        out.append(list(tensors[at : at + count]))
        at += count
    return out


def _multiply(
    kinds: Sequence[Sequence[str]],
    tensors: Sequence[list[torch.Tensor]],
    which: int,
    x: torch.Tensor,
) -> torch.Tensor:
    """LayerOps.multiply over the plan's kinds: linear `which` (layer.QKV..DOWN)."""
    return _linear(kinds[which], x, list(tensors[which]))


def _linear(kinds: Sequence[str], x: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """x [1, in] bf16 through the parts of one linear, taking their tensors off the front of
    `tensors`; the parts' outputs concatenated (q/k/v of two layouts: two products)."""
    outputs = []
    for kind in kinds:
        name, _, qtype = kind.partition(" ")
        if name == GGML:  # the raw blocks alone, their type in the kind
            outputs.append(torch.ops.glassbox.ggml_mm(x, tensors.pop(0), int(qtype)))
            continue
        taken = [tensors.pop(0) for _ in range(TENSORS[kind])]
        if kind == BF16:
            outputs.append(F.linear(x, taken[0]))
            continue
        y = _int4_mm(interleave_q6(x) if kind == INT4_Q6 else x, taken[0], BLOCK, taken[1])
        if kind == INT4_HALVES:  # [hi rows; lo rows]: their sum is the weight's product
            y = y[:, : y.shape[1] // 2] + y[:, y.shape[1] // 2 :]
        outputs.append(y)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=-1)


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
        self.window = _window(layer_plan(model))

    def __call__(
        self, x: torch.Tensor, ropes: tuple[Rope, ...], start: int, cache: KVBuffer
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        rope_tensors = tuple(rope.tensors() for rope in ropes)
        positions = step_positions(start, cache, self.window)
        inputs = (x, rope_tensors, positions, self.eps, self.weights, cache.keys, cache.values)
        return self.run(inputs)

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """decode_layers(*inputs) through the package, its inputs flattened as torch.export
        flattened them: depth first."""
        x, ropes, positions, eps, _, keys, values = inputs
        flat = [x, *(t for rope in ropes for t in rope), *positions, eps, *self.flat_weights]
        x, *queries = self.runner.run([*flat, *keys, *values])
        return x, queries


def _window(plan: Sequence[LayerPlan]) -> int:
    """The sliding layers' window (0: none slides)."""
    return max((p.window for p in plan), default=0)


class _DecodeLayers(torch.nn.Module):
    """decode_layers as the module torch.export traces, with the model's plan fixed."""

    def __init__(self, plan: Sequence[LayerPlan]) -> None:
        super().__init__()
        self.step = functools.partial(decode_layers, plan=plan)

    def forward(self, *inputs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
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
    window = _window(layer_plan(model))
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
    torch version or of older code (other thread counts stay: another command uses them)."""
    file_part, _, rest = path.name.partition("-torch")
    version = rest.split("-", 1)[0]
    code = path.stem.rsplit("-", 1)[-1]
    for other in path.parent.glob(f"{file_part}-torch*"):
        current = other.name.startswith(f"{file_part}-torch{version}-")
        if other != path and not (current and other.name.endswith(f"-{code}{path.suffix}")):
            other.unlink(missing_ok=True)


def load(path: Path, model: GGUFLlama) -> CompiledDecode:
    """The compiled step saved at `path`, bound to `model`'s weights."""
    loader = _package_loader()
    if loader is None:
        raise RuntimeError(f"torch {torch.__version__} cannot load the compiled step")
    # (package, model name, run single-threaded, runners, device index: -1 is the CPU)
    return CompiledDecode(loader(str(path), "model", False, 1, -1), model)


NOT_COMPILED = "eager: not compiled (turned off or not supported)"  # a load without an Attacher


class Attacher:
    """Gives a fast model its compiled step in the background: loads it if it is kept, else
    compiles it in a process of its own at low priority first. `done` is set either way."""

    def __init__(self, model: GGUFLlama, gguf: Path, path: Path, cache_dir: Path) -> None:
        self.model, self.gguf, self.path, self.cache_dir = model, gguf, path, cache_dir
        self.done = threading.Event()
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
        result = build_lock.build_once(self.path, command, cwd=root)
        if result is not None and result.returncode != 0:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"compiling exited with code {result.returncode}: {last}")


# A background compile must not slow the replies decoded meanwhile: it gets the idle CPU.
LOW_PRIORITY = ["nice", "-n", "19"] if shutil.which("nice") else []
BUILDER = "engine.load.compile_step"  # the module that compiles it (python -m)
