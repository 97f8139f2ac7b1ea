"""The fast model's decode step compiled ahead of time: one C++ function for every layer.

Eager, a decode step of the bundled model is ~9 ms of int4 kernels and ~1,000 small ops at a
few µs of dispatch each. AOTInductor (torch.export, then inductor's C++ code in a shared
library) runs the same ops as one function with the pointwise ones fused: measured 21.0 ms of
CPU a step against 36.1 eager here, on one thread.

Compiling takes ~2 minutes on 2 cores (longer under load), so it happens once per model
file, torch version, CPU, thread count and version of the step's code, in a background
process at low priority (`python -m engine.load.compile_step`, one build of a package at a time:
engine/disk/build_lock.py), and is kept in the cache folder as a .pt2 package. Until it is there
the model decodes eagerly; then a background thread loads it through torch's C++ package
loader (well under a second, and no dynamo or inductor import: ~1 MB, where loading a
torch.compile'd function took 4-7 s and ~130 MB) and the next step goes through it.

Only one-token passes through a cache are compiled; the prompt's pass and the no-cache
teaching mode stay eager. The probes stay the model's own: the function returns every layer's
queries and writes its keys into the cache, so a watched layer's attention is computed from
the q and k it attended with.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
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
from engine.model.kv_buffer import KVBuffer
from engine.model.llama import Attention, Block, GGUFLlama, QKNormAttention
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

LayerWeights = tuple[torch.Tensor, ...]  # norms, bias, then the tensors of 4 linears' parts


class Runner(Protocol):
    """torch._C._aoti.AOTIModelPackageLoader: the package's function on flat tensor lists."""

    def run(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]: ...


def refusal(model: GGUFLlama) -> str | None:
    """Why this model's decode step cannot be compiled here, or None if it can."""
    if model.device.type != "cpu":
        return f"the compiled step runs on the CPU, not on {model.device.type}"
    if _package_loader() is None:
        return f"torch {torch.__version__} is older than the {MIN_TORCH} the step is built for"
    for block in _blocks(model):
        if type(block) is not Block:
            return f"its {type(block).__name__} layers are not in the compiled step"
        if type(block.attention) not in (Attention, QKNormAttention):
            return f"its {type(block.attention).__name__} is not in the compiled step"
        for linear in _linears(block):
            if any(_kind(part) is None for part in _parts(linear)):
                return f"its {type(linear).__name__} weights are not in the compiled step"
    return None


# torch 2.11's package loader crashed (a segmentation fault) on a package it had just built
# here; 2.13 is the version the step is built and tested with.
MIN_TORCH = "2.13"


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


def _linears(block: Block) -> tuple[Linear, ...]:
    attention, feed_forward = block.attention, block.feed_forward
    return attention.qkv, attention.out, feed_forward.gate_up, feed_forward.down


# How one product of a layer runs in the compiled step, and how many tensors it takes; a
# GGML kernel's kind names its type ("ggml 12"), and takes the raw blocks alone.
INT4, INT4_HALVES, INT4_Q6, BF16, GGML = "int4", "int4 halves", "int4 per 16", "bf16", "ggml"
TENSORS = {INT4: 2, INT4_HALVES: 2, INT4_Q6: 2, BF16: 1}


@dataclass(frozen=True)
class LayerPlan:
    """The static shape of one layer's weights in the step: whether q/k/v have biases, and
    for qkv, out, gate_up and down the kind of each of their parts (a part per layout)."""

    bias: bool
    linears: tuple[tuple[str, ...], ...]
    qk_norm: bool = False  # Qwen3's: q and k heads RMS-normalised before RoPE
    attention_kernel: bool = False  # the GGML kernels' attend_one, not inductor's loops


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
            bias=block.attention.bias is not None,
            qk_norm=isinstance(block.attention, QKNormAttention),
            attention_kernel=ggml_kernel.in_use(),
            linears=tuple(
                tuple(cast("str", _kind(part)) for part in _parts(linear))
                for linear in _linears(block)
            ),
        )
        for block in _blocks(model)
    )


def disabled() -> str | None:
    """Why compiling is turned off ($GLASSBOX_COMPILE=0), or None."""
    return "$GLASSBOX_COMPILE is 0" if os.environ.get("GLASSBOX_COMPILE") == "0" else None


def decode_layers(
    x: torch.Tensor,
    rotation: torch.Tensor,
    filled: torch.Tensor,
    eps: torch.Tensor,
    weights: Sequence[LayerWeights],
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    plan: Sequence[LayerPlan],
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Every layer of a one-token pass: the ops of llama.Block for n = 1, written flat.

    x [1, dim] float32; rotation [1, d, d] (llama.Rope's matrix); filled: a [T, 0] tensor whose
    length is the positions after this one is written (a tensor, so that T is one dynamic size
    and not a constant of the graph); eps [1, 1]; weights per layer: the two norms, the
    q/k/v bias if the plan says so, then the tensors of each part of qkv, out, gate_up and
    down; keys/values [1, kv_heads, capacity, d] per layer. Returns x after the last layer and
    each layer's queries [1, heads, 1, d].
    """
    d = rotation.shape[-1]
    kv_heads = keys[0].shape[1]
    position = filled.shape[0] - 1
    queries = []
    for layer, (attention_norm, ffn_norm, *tensors) in enumerate(weights):
        k_cache, v_cache = keys[layer], values[layer]
        bias = tensors.pop(0) if plan[layer].bias else None
        qk_norm = tensors.pop(0) if plan[layer].qk_norm else None
        qkv_kinds, out_kinds, gate_up_kinds, down_kinds = plan[layer].linears
        qkv = _linear(qkv_kinds, _rms_norm(x, attention_norm, eps), tensors)
        if bias is not None:
            qkv = qkv + bias
        heads = qkv.shape[1] // d - 2 * kv_heads
        qk = qkv[:, : (heads + kv_heads) * d].view(1, -1, d).float()
        if qk_norm is not None:  # llama.QKNormAttention.before_rope
            qk = qk * (qk.square().mean(-1, keepdim=True) + eps).rsqrt() * qk_norm
        qk = torch.matmul(qk, rotation)
        qk = qk.to(torch.bfloat16).view(1, heads + kv_heads, 1, d)
        q = qk[:, :heads]
        k_cache[:, :, position : position + 1] = qk[:, heads:]
        v_cache[:, :, position : position + 1] = qkv[:, (heads + kv_heads) * d :].view(
            1, kv_heads, 1, d
        )
        seen_k, seen_v = k_cache[0, :, : position + 1], v_cache[0, :, : position + 1]
        grouped = q.view(kv_heads, heads // kv_heads, d)
        if plan[layer].attention_kernel:
            y = torch.ops.glassbox.attend_one(grouped, seen_k, seen_v)
        else:
            y = _attend_one(grouped, seen_k, seen_v)
        x = x + _linear(out_kinds, y.to(torch.bfloat16).view(1, heads * d), tensors)
        gate_up = _linear(gate_up_kinds, _rms_norm(x, ffn_norm, eps), tensors)
        ffn = gate_up.shape[1] // 2
        x = x + _linear(down_kinds, F.silu(gate_up[:, :ffn]) * gate_up[:, ffn:], tensors)
        queries.append(q)
    return x, queries


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One query per head over the cache, as products and sums inductor fuses into loops that
    read the bf16 keys and values as they are (SDPA on float32 copies read them three times,
    and the copies outgrow the CPU's caches at long contexts: at 5,000 keys the bundled
    model's step took 35.7 ms eagerly, 20-25 ms so). q [kv_h, g, d] (the g query heads of a
    key head), k and v [kv_h, T, d] -> [kv_h, g, d] float32."""
    scale = q.shape[-1] ** -0.5
    scores = (q.float()[:, :, None, :] * k.float()[:, None]).sum(-1).mul(scale)
    weights = scores.softmax(-1)  # [kv_h, g, T]
    return (weights[..., None] * v.float()[:, None]).sum(-2)


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


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """llama.rms_norm for one position, with eps as a tensor (a constant of the graph)."""
    inverse_rms = torch.addmm(eps, x, x.t(), alpha=1 / x.shape[1]).rsqrt()
    return (x * (weight * inverse_rms)).to(torch.bfloat16)


# The same norm for the GPU's static step (engine/step/static.py). A second name, not a
# rename: _rms_norm's source is part of _code_key, and a new name would rebuild every step.
one_row_norm = _rms_norm


def layer_weights(model: GGUFLlama) -> list[LayerWeights]:
    """Per layer: the two norms, the q/k/v bias if any, then each part's tensors (plan order)."""
    weights = []
    for block in _blocks(model):
        attention = block.attention
        extras = [] if attention.bias is None else [attention.bias]
        if isinstance(attention, QKNormAttention):
            extras.append(attention.qk_norm)
        tensors = [t for linear in _linears(block) for p in _parts(linear) for t in _tensors(p)]
        weights.append((block.attention_norm, block.ffn_norm, *extras, *tensors))
    return weights


class CompiledDecode:
    """The loaded compiled function with the model's weights, called like llama's layers."""

    def __init__(self, runner: Runner, model: GGUFLlama) -> None:
        self.runner = runner
        # decode_layers' inputs flattened as torch.export flattened them: depth first
        self.weights = [t for layer in layer_weights(model) for t in layer]
        self.eps = torch.full((1, 1), model.shape.eps)

    def __call__(
        self, x: torch.Tensor, rotation: torch.Tensor, start: int, cache: KVBuffer
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        filled = torch.empty(start + 1, 0)
        inputs = [x, rotation, filled, self.eps, *self.weights, *cache.keys, *cache.values]
        x, *queries = self.runner.run(inputs)
        return x, queries


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
    those tensors and no others), this module's own code (a changed step must not load an
    older one) and the thread count (the compiled loops are built for it)."""
    version = torch.__version__.replace("+", "-")
    isa = torch.backends.cpu.get_cpu_capability().lower()
    plan = hashlib.sha256(repr(layer_plan(model)).encode()).hexdigest()[:8]
    return folder / f"{stem}-{file_key}-torch{version}-{isa}-{plan}-{threads}t-{_code_key()}.pt2"


def _code_key() -> str:
    """A hash of the code a package is built from and called with (not of this whole file:
    a comment elsewhere in it must not cost every user a rebuild)."""
    parts = (decode_layers, _attend_one, _linear, interleave_q6, _rms_norm, compile_to,
             CompiledDecode.__call__, layer_weights, layer_plan, _tensors)  # fmt: skip
    source = "".join(inspect.getsource(part) for part in parts)
    return hashlib.sha256(source.encode()).hexdigest()[:12]


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
    from torch.export import Dim

    cache = model.new_cache()
    cache.reserve(64)  # example sizes that differ, so export does not take them for one
    filled = torch.empty(3, 0)
    x = torch.zeros(1, model.shape.dim)
    rotation = torch.eye(model.shape.head_dim)[None]
    eps = torch.full((1, 1), model.shape.eps)
    weights = layer_weights(model)
    inputs = (x, rotation, filled, eps, weights, cache.keys, cache.values)
    positions = Dim("positions", min=2)  # a one-token pass after at least one cached position
    capacity = Dim("capacity", min=3)  # the cache grows by chunks, keeping one position free
    dynamic = (None, None, {0: positions}, None, [(None,) * len(w) for w in weights],
               [{2: capacity}] * len(cache.keys), [{2: capacity}] * len(cache.values))  # fmt: skip
    with torch.no_grad():
        module = _DecodeLayers(layer_plan(model))
        # forward(*inputs): export binds them as one argument, so the shapes are nested once
        exported = torch.export.export(module, inputs, dynamic_shapes=(dynamic,))
    with _scratch_beside(path) as scratch:
        partial = scratch / "step.pt2"  # whole, then renamed: a load never sees half of one
        torch._inductor.aoti_compile_and_package(exported, package_path=str(partial))
        partial.replace(path)
    remove_stale(path)


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
