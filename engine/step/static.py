"""The fast model's decode step with fixed shapes, for a GPU to capture as one CUDA graph.

A decode step of the bundled model is ~1,000 small kernels; on a GPU the card is busy for a
small part of a step and the rest is Python dispatch and launches. Replaying the whole
step as one CUDA graph removes both, as in gpt-fast: the KV cache preallocated, the position
a device tensor updated in place, every shape fixed. Here:

- the cache comes in buckets (256, 512, 1024, ... up to the model's context): each bucket's
  tensors are allocated once per model and reused by every conversation, so a graph records
  their addresses once; growing to the next bucket copies the filled part once
  (`BucketedKVBuffer`). The buckets up to AHEAD positions are recorded during the load (the
  first is the compile every bucket shares), the later ones in the background ahead of the
  context (engine/step/bucket_recorder.py); a step whose bucket is not ready yet runs
  uncaptured: a reply never waits for a recording (`StaticDecode.builds` counts them);
- the step (`static_step`) embeds the token from a dense table, builds the rotations from the
  device position, and runs every layer through engine/model/layer.py's `decode_layer` (the
  eager forward's own layer) with ops that write k and v at that position and attend over
  the whole bucket with a mask beyond it (and outside a sliding layer's window), then the
  lm_head: the model's own modules, with no host value anywhere;
- the probes stay outside the graph: the step returns every layer's queries and every
  layer's output (as the CPU's compiled step does, engine/step/compiled.py); a watched
  layer's attention is computed from the queries and the cached keys right after the step,
  before the next replay overwrites its outputs, and a watched logit lens keeps a copy of the
  layers' outputs; the logits are cloned out. Changing what is watched never records again.

Backends (`choose_backend`): on CUDA with Triton, the step whose layers run inductor's kernels
(`compiled_layer`: one compile for every layer and bucket, the weights its inputs) captured as
a `torch.cuda.CUDAGraph`; on CUDA without Triton (Windows), the same capture of the eager
static step; both warmed up on a side stream first. Elsewhere the same
step runs uncaptured and is bound at once (what the CPU tests exercise, with a slow injected
recording standing in for a capture; the CPU's default stays the AOTInductor step). Prefill
stays eager, writing into the same bucketed cache.

CI has no GPU: the captures themselves are checked by `make gpu-check` on a CUDA machine
(docs/gpu.md), which also runs `glassbox bench --device cuda`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F

from engine.model.attention_probe import AttentionProbe
from engine.model.kv_buffer import KVBuffer
from engine.model.layer import LayerOps, Rope, decode_layer, norm_row, rotate
from engine.model.llama import Attention, Block, GGUFLlama
from engine.step.bucket_recorder import BucketRecorder
from engine.step.flat import layers_refusal

log = logging.getLogger(__name__)

FIRST_BUCKET = 256  # positions of the smallest cache; each next bucket doubles it

EAGER, COMPILE, CAPTURE = "eager", "torch.compile", "captured"
STATES = {COMPILE: "cuda graph (torch.compile)", CAPTURE: "cuda graph (captured)"}
WARMUP = 3  # uncaptured runs on a side stream before a capture (the CUDA graph docs' advice)

AHEAD = 1024  # positions whose buckets are recorded from the start, before any reply
LOAD_WAIT_S = 600.0  # the most a load waits for its buckets (the compile); then uncaptured

Buffers = tuple[list[torch.Tensor], list[torch.Tensor]]  # keys, values per layer
# logits [vocab], queries [1, h, 1, d], each layer's output [layers, dim] float32
StepOut = tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]
Replay = Callable[[], StepOut]
# (block, x, rope tensors, its keys, its values, position, eps) -> (x, q): bucket_layer's form
Layer = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (step, its inputs, same-shaped ones for the warm-ups) -> the recorded step
Record = Callable[[Callable[..., StepOut], tuple[Any, ...], tuple[Any, ...]], Replay]


def bucket_for(tokens: int, context: int, first: int = FIRST_BUCKET) -> int:
    """The smallest bucket holding `tokens` positions: first, 2·first, ... capped at the
    model's context (0: unknown), and never smaller than `tokens`."""
    size = first
    while size < tokens:
        size *= 2
    if context:
        size = min(size, context)
    return max(size, tokens)


def triton_available() -> bool:
    """Whether torch.compile can generate CUDA kernels here (Triton has no Windows build)."""
    return importlib.util.find_spec("triton") is not None


def choose_backend(device: torch.device) -> tuple[str, str | None]:
    """The backend for `device` and, where it is eager, why."""
    if device.type != "cuda":
        return EAGER, f"no CUDA graph on {device.type} (the static step runs uncaptured)"
    return (COMPILE if triton_available() else CAPTURE), None


def refusal(model: GGUFLlama) -> str | None:
    """Why the static step cannot run this model, or None if it can."""
    if model.compile_refusal is not None:
        return model.compile_refusal.replace("compiled step", "static step")
    return layers_refusal(model, "static step")


class BucketedKVBuffer(KVBuffer):
    """A KVBuffer whose tensors are whole buckets drawn from `buffers(capacity)`: the same
    tensors every time a bucket is used, so a graph recorded over them stays valid."""

    def __init__(
        self, model: GGUFLlama, buffers: Callable[[int], Buffers], first: int = FIRST_BUCKET
    ) -> None:
        s = model.shape
        super().__init__(s.layers, s.kv_heads, s.head_dim, model.cache_dtype, model.device)
        self.context, self.buffers, self.first = s.context, buffers, first

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions: the next bucket, the filled part copied there once."""
        if tokens <= self.capacity:
            return
        keys, values = self.buffers(bucket_for(tokens, self.context, self.first))
        for old, new in ((self.keys, keys), (self.values, values)):
            for layer, tensor in enumerate(old):
                new[layer][:, :, : self.length] = tensor[:, :, : self.length]
        self.keys, self.values = list(keys), list(values)
        self._per_position = None


def static_step(
    model: GGUFLlama,
    table: torch.Tensor,
    token: torch.Tensor,
    position: torch.Tensor,
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    layer: Layer | None = None,
) -> StepOut:
    """One token through every layer and the lm_head, every shape fixed by the bucket.

    table [vocab, dim] float32 (the embedding's rows, Embedding.table); token, position [1]
    int64; keys/values [1, kv_h, bucket, d] per layer, written at `position`. `layer` runs
    each layer: `bucket_layer`, or its compiled form (`compiled_layer`). Returns the logits
    [vocab] float32, each layer's queries [1, h, 1, d] bf16 and each layer's output
    [layers, dim] float32 (the residual stream a logit lens reads).
    """
    run_layer = layer or bucket_layer
    eps = torch.full((1, 1), model.shape.eps, device=table.device)
    x = table[token]  # [1, dim] float32
    matrix = model.rope_matrix_rows >= 1  # the form the eager one-token pass rotates by
    ropes = [
        Rope.at(position, frequencies, matrix).tensors() for frequencies in model.frequencies()
    ]
    queries, outputs = [], []
    for index, module in enumerate(model.blocks):
        block = cast(Block, module)
        x, q = run_layer(block, x, ropes[block.rope], keys[index], values[index], position, eps)
        queries.append(q)
        outputs.append(x)
    logits = model.output.forward(norm_row(x, model.norm, eps))
    return logits[0], queries, torch.cat(outputs)


def bucket_layer(
    block: Block,
    x: torch.Tensor,
    rope: tuple[torch.Tensor, ...],
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    eps: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of the static step (layer.decode_layer) over its bucket: x [1, dim] float32
    -> (x after the layer, its query). A plain function of the block and tensors, so that one
    compile serves every layer of a model (`compiled_layer`)."""
    attention = block.attention
    key_positions = torch.arange(keys.shape[2], device=keys.device)  # [bucket]
    mask = key_positions <= position
    if attention.window is not None:  # a sliding layer: within its window too
        mask = mask & (key_positions > position - attention.window)
    write = functools.partial(_write_at, keys, values, position)
    attend = functools.partial(_attend_bucket, attention, mask)
    ops = LayerOps(block.multiply, functools.partial(rotate, rope=rope), write, attend)
    return decode_layer(x, block.weights(), block.form, eps, ops)


def _write_at(
    keys: torch.Tensor,
    values: torch.Tensor,
    position: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The new key and value at the device position; the query sees the whole bucket."""
    keys.index_copy_(2, position, k.to(keys.dtype))
    values.index_copy_(2, position, v.to(values.dtype))
    return keys, values


def _attend_bucket(
    attention: Attention, mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """q [1, h, 1, d] over a whole bucket, the positions it may not see masked out."""
    return F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask.view(1, 1, 1, -1),
        scale=attention.scale, enable_gqa=k.shape[1] != q.shape[1],
    )  # fmt: skip


class StaticDecode:
    """The model's one-token passes through a static step: buckets, graphs, probes.

    `run(ids, cache, probe)` returns the logits, or None where it cannot take the pass (a cache
    it did not make); GGUFLlama.forward then runs eagerly. One cache per model at a time: a new
    cache reuses the bucket tensors of the last one (a session holds one).

    Where a recording costs time (a CUDA graph; or a `record` given, as the tests give a slow
    one), buckets are recorded in the background (engine/step/bucket_recorder.py): every
    bucket up to `ahead` positions from the start, then up to four times the context, so two
    buckets lie ahead of it; a step whose bucket is not ready runs uncaptured meanwhile. A
    recording never writes the bucket (its warm-ups run on zeroed twins), and each bucket has
    its own token and position tensors for its replays; the uncaptured steps use shared ones.
    """

    def __init__(
        self,
        model: GGUFLlama,
        backend: str,
        reason: str | None = None,
        first: int = FIRST_BUCKET,
        record: Record | None = None,
        ahead: int = AHEAD,
    ) -> None:
        self.model, self.backend, self.first, self.ahead = model, backend, first, ahead
        self.reason = reason  # why it runs uncaptured, if it does
        self.table = model.embedding.table().to(model.device)  # [vocab, dim] float32
        self.token, self.position = _inputs(model.device)  # the uncaptured steps'
        self.pool: dict[int, Buffers] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each bucket's own
        self._pool_lock = threading.Lock()
        self.steps: dict[int, Callable[[], StepOut]] = {}
        self.builds = 0  # graphs recorded (or uncaptured steps bound): one per bucket used
        self._record = record
        self.background = record is not None or backend != EAGER
        self.recorder = BucketRecorder(self._build, name="static-decode-recorder")
        self.planned = 0  # the largest bucket asked of the recorder
        model, table = self.model, self.table
        layer = compiled_layer() if backend == COMPILE else bucket_layer

        def step(token: torch.Tensor, position: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> StepOut:  # fmt: skip
            return static_step(model, table, token, position, keys, values, layer)

        self.step = step

    @property
    def state(self) -> str:
        """What the status shows: "cuda graph (torch.compile)", "... (captured)", "eager: why"."""
        return STATES.get(self.backend, f"eager: {self.reason}")

    def new_cache(self) -> BucketedKVBuffer:
        self.plan(0)
        return BucketedKVBuffer(self.model, self.buffers, self.first)

    def buffers(self, capacity: int) -> Buffers:
        """The bucket's tensors, allocated on first use and kept for the model's life."""
        with self._pool_lock:  # the recorder's thread allocates too
            if capacity not in self.pool:
                s = self.model.shape
                shape = (1, s.kv_heads, capacity, s.head_dim)
                new = [torch.zeros(shape, dtype=self.model.cache_dtype, device=self.model.device)
                       for _ in range(2 * s.layers)]  # fmt: skip
                self.pool[capacity] = (new[: s.layers], new[s.layers :])
                self.inputs[capacity] = _inputs(self.model.device)
            return self.pool[capacity]

    def plan(self, length: int) -> None:
        """Ask the recorder for every bucket up to max(ahead, 4·length) positions (background
        recording only); the smallest are recorded first."""
        if not self.background:
            return
        context = self.model.shape.context
        target = max(self.ahead, 4 * length, 1)
        last = bucket_for(min(target, context) if context else target, context, self.first)
        if last <= self.planned:
            return
        self.planned = last
        sizes, size = [], bucket_for(1, context, self.first)
        while size < last:
            sizes.append(size)
            size = bucket_for(size + 1, context, self.first)
        self.recorder.request([*sizes, last])

    def close(self, timeout: float | None = None) -> bool:
        """Stop recording (at unload and quit): the queued buckets dropped, the thread joined."""
        return self.recorder.close(timeout)

    def run(
        self, ids: torch.Tensor, cache: KVBuffer, probe: AttentionProbe | None
    ) -> torch.Tensor | None:
        """ids [1, 1] (on the device) after the cache's positions -> logits [vocab]."""
        if not isinstance(cache, BucketedKVBuffer) or cache.buffers != self.buffers:
            return None
        start = cache.length
        cache.reserve(start + 1)
        token, position, step = self._step(cache.capacity)
        token.copy_(ids.reshape(1))  # device to device: no host sync
        position.fill_(start)
        logits, queries, residuals = step()
        cache.length = start + 1
        self.plan(cache.length)
        copy = self.backend != EAGER  # a graph's outputs are overwritten by its next replay
        if probe is not None:
            self.model.watch(probe, queries, cache, start, reused=copy)
        if self.model.keep_residuals is not None:
            self.model.keep_residuals(residuals.clone() if copy else residuals)
        return logits.clone() if copy else logits

    def _step(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor, Replay]:
        """The bucket's step and the inputs it reads: its recorded one where ready (bound here
        where nothing is recorded), else an uncaptured one on the shared inputs."""
        if not self.background:
            if capacity not in self.steps:
                self.steps[capacity] = self._build(capacity)
            return (*self.inputs[capacity], self.steps[capacity])
        step = self.recorder.ready(capacity)
        if step is not None:
            return (*self.inputs[capacity], step)
        if capacity <= (self.model.shape.context or capacity):  # past it: a bucket per token
            self.recorder.request([capacity], urgent=True)  # the reply is in it: next
        keys, values = self.pool[capacity]
        inputs = (self.token, self.position, keys, values)
        return self.token, self.position, lambda: static_step(self.model, self.table, *inputs)

    def _build(self, capacity: int) -> Replay:
        """The step over the bucket's tensors, captured by the backend (eager if it fails).
        The recording's warm-ups (which run the step, and compile it) get zeroed tensors of the
        same shapes, never the bucket's: a reply may be using it meanwhile."""
        self.builds += 1
        keys, values = self.buffers(capacity)
        token, position = self.inputs[capacity]
        step, model, table = self.step, self.model, self.table
        inputs = (token, position, keys, values)
        record = self._record or recording(self.backend)
        if record is None:  # uncaptured: nothing runs now
            return lambda: step(*inputs)
        try:
            return record(step, inputs, _zeros_like(inputs))
        except Exception as error:  # the uncaptured step still decodes: say why, once
            self.backend, self.reason = EAGER, f"{type(error).__name__}: {error}"
            log.warning("the decode step stays uncaptured: %s", self.reason)
            return lambda: static_step(model, table, *inputs)


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A step's token and position [1] int64."""
    token = torch.zeros(1, dtype=torch.long, device=device)
    return token, torch.zeros_like(token)


def _zeros_like(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Tensors (and lists of them) of the same shapes, zeroed."""
    return tuple(
        [torch.zeros_like(t) for t in item] if isinstance(item, list) else torch.zeros_like(item)
        for item in inputs
    )


def captured(
    step: Callable[..., StepOut], inputs: tuple[Any, ...], warm: tuple[Any, ...]
) -> Replay:
    """A plain torch.cuda.CUDAGraph of the step over `inputs`, warmed up over `warm` (tensors of
    the same shapes: a capture only records, the warm-ups run). Captured in the recorder's
    thread: "thread_local" lets the decoding thread launch its own work meanwhile."""
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP):
            step(*warm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = step(*inputs)

    def replay() -> StepOut:
        graph.replay()
        return out

    return replay


_compile_lock = threading.Lock()
_compiled_layers: dict[Any, Layer] = {}
LONGEST_BUCKET = 1 << 24  # the dynamic bucket length's upper bound: past any model's context
RECOMPILES = 64  # the layer's compiles a process allows: one per layer kind of each model shape


def compiled(
    step: Callable[..., StepOut], inputs: tuple[Any, ...], warm: tuple[Any, ...]
) -> Replay:
    """The step with its layers' kernels from inductor (`compiled_layer`), captured as one
    CUDA graph as above (the first warm-up compiles). Not mode="reduce-overhead": its graphs
    belong to the thread that records them, and this one records in the background for the
    decoding thread. The bucket's length is a dynamic dimension (`bucket_dynamic`), so each
    later bucket is a capture alone, not a compile of its own."""
    return captured(step, bucket_dynamic(inputs), bucket_dynamic(warm))


def compiled_layer(backend: str | Callable[..., Any] = "inductor") -> Layer:
    """`bucket_layer` through torch.compile, made once per process: every layer of a model
    takes the same compiled code (its weights are inputs, not constants: a model's thirty
    layers are one compile, not thirty), as does every bucket, and a model of the same shape
    loaded later. A sliding layer, or another shape, is a compile of its own."""
    import torch._dynamo

    with _compile_lock:
        config = torch._dynamo.config
        config.recompile_limit = max(getattr(config, "recompile_limit", 0), RECOMPILES)
        if backend not in _compiled_layers:
            _compiled_layers[backend] = torch.compile(
                bucket_layer, fullgraph=True, dynamic=False, backend=backend
            )
        return _compiled_layers[backend]


def bucket_dynamic(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """Mark the keys' and values' bucket length (dim 2) dynamic in a step's inputs (token,
    position, keys, values): one compiled graph for every bucket length."""
    import torch._dynamo

    for tensors in inputs[2:]:
        for tensor in tensors:
            torch._dynamo.mark_dynamic(tensor, 2, min=2, max=LONGEST_BUCKET)
    return inputs


def keep_kernels(folder: Path) -> None:
    """Keep inductor's compiled kernels and graphs in `folder` (Glassbox's cache) rather than
    the system's temporary folder: a later start compiles the step from them in far less time.
    A folder the user chose ($TORCHINDUCTOR_CACHE_DIR) stays theirs; torch's own default, which
    importing dynamo writes into the variable, does not."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == _inductor_default():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)


def _inductor_default() -> str | None:
    """The folder inductor uses where none is chosen (None: a torch that does not say)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def recording(backend: str) -> Record | None:
    """How `backend` records a step; None where it runs uncaptured."""
    return {COMPILE: compiled, CAPTURE: captured}.get(backend)


class StepState:
    """What the server reports as the `decode_step` status (as compiled_decode.Attacher):
    known at load, so `done` is set at once; `state` follows a fallback to uncaptured."""

    def __init__(self, step: StaticDecode) -> None:
        self.step = step
        self.done = threading.Event()
        self.done.set()
        self.error: str | None = None
        self.load_wait_s = 0.0  # what the load waited for the buckets recorded with it

    @property
    def state(self) -> str:
        return self.step.state

    def close(self, timeout: float | None = None) -> bool:
        """Stop the step's background recording (the model is unloaded, or the engine quits)."""
        return self.step.close(timeout)

    def recorded(self, timeout: float | None = None) -> tuple[list[int], bool]:
        """Wait (at most `timeout` s) for the buckets asked for so far: those ready, and
        whether every one is."""
        done = self.step.recorder.idle(timeout)
        return self.step.recorder.buckets, done


def attach(
    model: GGUFLlama,
    device: torch.device | None = None,
    kernels: Path | None = None,
    report: Callable[[str, float], None] | None = None,
) -> StepState | None:
    """Give `model` the static step for its device; None (and logged why) where it cannot.
    Where the step is recorded (a CUDA graph), the load waits for the buckets up to AHEAD
    positions: the first is the one compile every bucket shares (its kernels kept in
    `kernels`), the others captures alone. No reply then runs beside a recording, which holds
    the interpreter (a compile, the uncaptured step's crawl, for tens of seconds)."""
    reason = refusal(model)
    if reason is not None:
        log.info("the decode step stays eager: %s", reason)
        return None
    backend, why = choose_backend(device or model.device)
    if backend != EAGER and kernels is not None:
        keep_kernels(kernels)
    step = StaticDecode(model, backend, why)
    model.static_step = step
    step.plan(0)  # the first buckets start recording now, before the first reply
    log.info("decode step: %s", step.state)
    state = StepState(step)
    if backend != EAGER:
        if report is not None:
            report("Compiling the decode step for the GPU (kept for later starts)", 0.98)
        began = time.perf_counter()
        step.recorder.idle(LOAD_WAIT_S)
        state.load_wait_s = time.perf_counter() - began
        buckets = ", ".join(map(str, step.recorder.buckets))
        log.info("decode step: the load waited %.1f s for buckets %s", state.load_wait_s, buckets)
    return state
