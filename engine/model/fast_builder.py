"""Glassbox's own model (GGUFLlama, GGUFGemma) on a GGUF's quantised weights: each weight held
in the layout its kernels multiply fastest (the file's own blocks in the GGML kernels, int4
repacked for torch's kernel, or bf16), and the plan a placement makes of it."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import cast

import torch

from engine.gguf import blocks as ggml_blocks
from engine.gguf.reader import GGUFFile
from engine.model.gemma import (
    GemmaAttention,
    GemmaBlock,
    GemmaEmbedding,
    GemmaFeedForward,
    GGUFGemma,
)
from engine.model.gguf_shape import TensorProgress, raw_rows, read_shape, release_freed_memory
from engine.model.llama import (
    Attention,
    Block,
    Embedding,
    FeedForward,
    GGUFLlama,
    Head,
    LlamaShape,
    QKNormAttention,
    qk_norm_weights,
)
from engine.weights import ggml_kernel
from engine.weights import linear as quant
from engine.weights.pack_cache import PackCache

log = logging.getLogger(__name__)

ROW_CHUNK = 2048  # rows repacked at a time, so a large lm_head never exists in float32 whole


def build_fast(
    file: GGUFFile,
    progress: TensorProgress | None = None,
    packs: PackCache | None = None,
    kernels: bool = True,
    mapped_layers: frozenset[int] = frozenset(),
    device_blocks: bool = False,
) -> GGUFLlama:
    """GGUFLlama on the file's quantised weights: the file's blocks in the GGML kernels where
    they run and `kernels` allows (a GPU's form is made from the int4 layouts instead), else
    int4 weights repacked (others dequantised to bf16); with `packs`, what is repacked comes
    from (and goes to) the cache folder's pack. The GGML weights of `mapped_layers` (placed
    on disk) are views of the mapped file instead of copies read in, fused where the file
    holds the parts side by side (llama's q/k, whose rows are reordered, are copied all the
    same). With `device_blocks`, every weight of a type engine/gguf/torch_blocks.py reads
    stays the file's blocks, for engine/model/to_device.py to dequantise on the device."""
    builder = _Builder(file, progress, packs, kernels, device_blocks)
    shape = builder.shape
    blocks = [builder.block(i, i in mapped_layers) for i in range(shape.layers)]
    output = _head(file, shape, packs, builder.ggml, device_blocks)
    builder.advance(1)
    embedding = _embedding(file, shape)
    norm = builder.vector("output_norm.weight")
    if builder.dense_parts:
        log.info(_dense_note(file, builder.dense_parts))
    model: GGUFLlama
    if shape.architecture == "gemma3":
        local = _frequencies(shape.head_dim, shape.local_rope_base)
        embedding = GemmaEmbedding(embedding.lookup, shape.dim)
        model = GGUFGemma(shape, embedding, blocks, norm, output, _inv_freq(file, shape), local)
    else:
        model = GGUFLlama(shape, embedding, blocks, norm, output, _inv_freq(file, shape))
    model.eval()
    release_freed_memory()
    if packs is not None:
        packs.save()
    return model


class _Builder:
    """One file's layers built weight by weight, the tensors read counted for `progress`."""

    def __init__(
        self,
        file: GGUFFile,
        progress: TensorProgress | None,
        packs: PackCache | None,
        kernels: bool,
        device_blocks: bool,
    ) -> None:
        self.file, self.progress, self.packs = file, progress, packs
        self.shape = read_shape(file)
        self.device_blocks = device_blocks
        self.ggml = device_blocks or (kernels and ggml_kernel.in_use())
        self.total = len(file.tensors)
        self.done = 0
        self.dense_parts: list[str] = []  # dequantised to bf16 (the log says which)

    def advance(self, tensors: int) -> None:
        self.done += tensors
        if self.progress is not None:
            self.progress(self.done, self.total)

    def block(self, i: int, in_file: bool) -> Block:
        """Layer i; with `in_file`, its GGML weights are views of the mapped file."""
        p, shape = f"blk.{i}.", self.shape
        attention_weights = (p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight")
        qkv = self.linear(*attention_weights, in_file=in_file)
        out = self.linear(p + "attn_output.weight", in_file=in_file)
        gate_up = self.linear(p + "ffn_gate.weight", p + "ffn_up.weight", in_file=in_file)
        down = self.linear(p + "ffn_down.weight", in_file=in_file)
        if shape.architecture == "gemma3":
            block: Block = _gemma_block(shape, i, (qkv, out, gate_up, down), p, self.vector)
        else:
            attention = _attention(shape, qkv, out, p, self.file, self.vector)
            feed_forward = FeedForward(gate_up, down, shape.ffn)
            norms = (self.vector(p + "attn_norm.weight"), self.vector(p + "ffn_norm.weight"))
            block = Block(attention, feed_forward, norms, shape.eps)
        release_freed_memory()
        return block

    def linear(self, *parts: str, in_file: bool = False) -> quant.Linear:
        """The fused weight of `parts`: each run of parts of one layout is one product (with
        `in_file`, GGML runs are cut where the parts cannot be one view of the file)."""
        runs = _runs(self.file, parts, self.ggml, self.device_blocks)
        if in_file:
            runs = _in_file_runs(self.file, self.shape, runs)
        built = [self.layout_linear(layout, run, in_file) for layout, run in runs]
        return built[0] if len(built) == 1 else quant.PartsLinear(built)

    def layout_linear(self, layout: str, parts: list[str], in_file: bool) -> quant.Part:
        tensors = self.file.tensors
        if layout.startswith(GGML):  # the file's own blocks: nothing to repack or keep
            viewed = in_file and not _reordered(self.shape, parts[0])
            weight = self.in_place(parts) if viewed else self.take(*parts)
            part_rows = tuple(tensors[p].shape[0] for p in parts)
            return quant.GGMLLinear(
                weight, tensors[parts[0]].type, tensors[parts[0]].shape[-1], part_rows
            )
        if layout == BF16:
            self.dense_parts.extend(parts)
        if self.packs is None:
            return self.repacked(layout, parts)
        rows = sum(tensors[p].shape[0] for p in parts)
        before = self.done
        built = self.packs.linear(
            parts[0], rows, tensors[parts[0]].shape[-1], lambda: self.repacked(layout, parts)
        )
        self.advance(len(parts) - (self.done - before))  # a stored linear read nothing: count it
        return built

    def repacked(self, layout: str, parts: list[str]) -> quant.Part:
        """`parts` read from the file into `layout` (int4, Q6_K's int4 form or bf16)."""
        if layout == BF16:
            self.advance(len(parts))
            return quant.DenseLinear(_dense(self.file, self.shape, parts).to(torch.bfloat16))
        if layout == Q6_INT4:
            return quant.Q6KLinear.from_blocks(self.take(*parts))
        return _int4_run([(self.take(p), self.file.tensors[p].type) for p in parts])

    def take(self, *parts: str) -> torch.Tensor:
        """The parts' rows read in (one copy: a lone part is not copied again)."""
        self.advance(len(parts))
        rows = [raw_rows(self.file, self.shape, p) for p in parts]
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def in_place(self, parts: list[str]) -> torch.Tensor:
        """The parts' rows as a view of the mapped file (adjacent there: see _in_file_runs)."""
        self.advance(len(parts))
        return torch.from_numpy(self.file.raw_run(parts))

    def vector(self, name: str) -> torch.Tensor:
        info = self.file.tensors[name]
        return quant.dense(self.take(name), info.type, info.shape[-1]).reshape(-1).clone()


def _attention(
    shape: LlamaShape,
    qkv: quant.Linear,
    out: quant.Linear,
    prefix: str,
    file: GGUFFile,
    vector: Callable[[str], torch.Tensor],
) -> Attention:
    """Llama's attention, with Qwen2's q/k/v biases or Qwen3's QK-norm where the file has them."""
    if prefix + "attn_q_norm.weight" in file.tensors:  # Qwen3
        q_norm, k_norm = (vector(f"{prefix}attn_{x}_norm.weight") for x in "qk")
        return QKNormAttention(shape, qkv, out, qk_norm_weights(shape, q_norm, k_norm))
    bias_names = [prefix + f"attn_{x}.bias" for x in "qkv"]
    bias = None
    if all(b in file.tensors for b in bias_names):
        bias = torch.cat([vector(b) for b in bias_names]).to(torch.bfloat16)
    return Attention(shape, qkv, out, bias)


def _gemma_block(
    shape: LlamaShape,
    layer: int,
    linears: tuple[quant.Linear, quant.Linear, quant.Linear, quant.Linear],
    prefix: str,
    vector: Callable[[str], torch.Tensor],
) -> GemmaBlock:
    """A Gemma 3 block from its linears (qkv, out, gate_up, down) and the file's norms, which
    llama.cpp's converter stores as 1 + w already (its norm_shift): used as they are."""
    qkv, out, gate_up, down = linears
    q_norm, k_norm = vector(prefix + "attn_q_norm.weight"), vector(prefix + "attn_k_norm.weight")
    qk_norm = qk_norm_weights(shape, q_norm, k_norm)
    window = shape.sliding_window if layer in shape.sliding_layers else None
    attention = GemmaAttention(shape, qkv, out, qk_norm, window)
    names = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm")
    before, after_attention, before_ffn, after_ffn = (vector(f"{prefix}{n}.weight") for n in names)
    norms = (before, after_attention, before_ffn, after_ffn)
    return GemmaBlock(attention, GemmaFeedForward(gate_up, down, shape.ffn), norms, shape.eps)


# the layouts of a weight
BF16, PLAIN_INT4, SPLIT_INT4, Q6_INT4 = "bf16", "int4", "int4 halves", "int4 per 16"
GGML = "ggml"  # the GGML kernels, "ggml <type>": one product per type


def _layout(file: GGUFFile, name: str, ggml: bool, any_blocks: bool = False) -> str:
    """How a weight is held: a type the GGML kernels read, as the file's blocks where they are
    loaded (engine/weights/ggml_kernel.py); otherwise 4-bit types repacked as they are for torch's
    int4 kernel, 5- and 8-bit ones in two int4 halves, Q6_K in int4 groups of its own
    (quant.Q6KLinear) where the AVX-512 kernels run (under AVX2 a bf16 copy multiplies
    faster), others (F16, Q2_K...) dequantised to bf16. `any_blocks`: every block type
    ggml_blocks reads stays the file's blocks (for a device to dequantise)."""
    info = file.tensors[name]
    whole_blocks = info.shape[-1] % ggml_blocks.BLOCK_VALUES.get(info.type, 1) == 0
    held = info.type in ggml_blocks.BLOCK_BYTES if any_blocks else ggml_kernel.holds(info.type)
    if ggml and whole_blocks and held:
        return f"{GGML} {info.type}"
    if info.shape[0] % 16:  # the int4 kernel's rule
        return BF16
    if info.type == quant.Q6_K:
        return Q6_INT4 if quant.kernel_block_rows() == 64 else BF16
    return (
        PLAIN_INT4 if info.type in quant.PLAIN else SPLIT_INT4 if info.type in quant.SPLIT else BF16
    )


def _runs(
    file: GGUFFile, parts: Iterable[str], ggml: bool, any_blocks: bool = False
) -> list[tuple[str, list[str]]]:
    """`parts` in runs of one layout, in order: q, k (Q4_K) and v (Q6_K) -> [q, k], [v]."""
    runs: list[tuple[str, list[str]]] = []
    for name in parts:
        layout = _layout(file, name, ggml, any_blocks)
        if runs and runs[-1][0] == layout:
            runs[-1][1].append(name)
        else:
            runs.append((layout, [name]))
    return runs


def _reordered(shape: LlamaShape, name: str) -> bool:
    """Whether raw_rows reorders this tensor's rows (llama's q and k): it cannot be a view."""
    return shape.architecture == "llama" and name.endswith(("attn_q.weight", "attn_k.weight"))


def _in_file_runs(
    file: GGUFFile, shape: LlamaShape, runs: list[tuple[str, list[str]]]
) -> list[tuple[str, list[str]]]:
    """GGML runs cut so that each piece is one view of the mapped file (its parts adjacent
    there) or one copy (parts whose rows are reordered, fused as before)."""
    cut: list[tuple[str, list[str]]] = []
    for layout, run in runs:
        if not layout.startswith(GGML):
            cut.append((layout, run))
            continue
        piece = [run[0]]
        for name in run[1:]:
            copied = _reordered(shape, piece[-1])
            if copied == _reordered(shape, name) and (copied or file.adjacent(piece[-1], name)):
                piece.append(name)
            else:
                cut.append((layout, piece))
                piece = [name]
        cut.append((layout, piece))
    return cut


def _dense_note(file: GGUFFile, names: list[str]) -> str:
    """One line: which tensors were dequantised to bf16, and what that costs in memory."""
    infos = [file.tensors[n] for n in names]
    stored = sum(info.nbytes for info in infos)
    held = sum(2 * math.prod(info.shape) for info in infos)
    kinds: dict[str, int] = {}  # names with the layer number left out, counted
    for name in names:
        kind = ".".join("*" if part.isdigit() else part for part in name.split("."))
        kinds[kind] = kinds.get(kind, 0) + 1
    types = ", ".join(sorted({info.type_name for info in infos}))
    listed = ", ".join(f"{kind} ({count})" if count > 1 else kind for kind, count in kinds.items())
    return (
        f"{len(names)} tensors ({types}) have no exact int4 layout and were dequantised to bf16:"
        f" {held / 1e6:.0f} MB held for {stored / 1e6:.0f} MB in the file"
        f" (+{(held - stored) / 1e6:.0f} MB): {listed}"
    )


def _int4_run(
    parts: list[tuple[torch.Tensor, int]], dtype: torch.dtype = torch.bfloat16
) -> quant.Int4Linear:
    """Raw rows of PLAIN (or of SPLIT) types as one linear (scales in `dtype`), repacked in
    chunks of ROW_CHUNK rows across the parts, so a large weight never exists unpacked whole."""

    def build(start: int) -> quant.Int4Linear:
        pieces, offset = [], 0
        for raw, qtype in parts:
            low, high = max(start - offset, 0), min(start + ROW_CHUNK - offset, raw.shape[0])
            if low < high:
                pieces.append((raw[low:high], qtype))
            offset += raw.shape[0]
        return quant.Int4Linear.from_parts(pieces, dtype)

    return _join(build, sum(raw.shape[0] for raw, _ in parts))


def _join(build: Callable[[int], quant.Int4Linear], rows: int) -> quant.Int4Linear:
    """One linear from `build(start)` of each chunk of ROW_CHUNK rows (a multiple of 64, so
    the packed chunks join row-wise; a split weight keeps its [hi rows; lo rows] order)."""
    parts = []
    for start in range(0, rows, ROW_CHUNK):
        parts.append(build(start))
        release_freed_memory()
    if len(parts) == 1:
        return parts[0]
    halves = (0,) if parts[0].plain else (0, 1)
    packed, scales = [], []
    for half in halves:
        for part in parts:
            n = part.out_features
            packed.append(part.packed[half * n : (half + 1) * n])
            scales.append(part.scales_zeros[:, half * n : (half + 1) * n])
    return quant.Int4Linear(torch.cat(packed), torch.cat(scales, dim=1), rows)


def _embedding(file: GGUFFile, shape: LlamaShape) -> Embedding:
    """Rows stay as stored (mapped from the file); a lookup expands only the rows it needs."""
    info = file.tensors["token_embd.weight"]
    return Embedding(quant.RowReader(torch.from_numpy(file.raw(info.name)), info.type, shape.dim))


def _head(
    file: GGUFFile,
    shape: LlamaShape,
    packs: PackCache | None = None,
    ggml: bool = False,
    device_blocks: bool = False,
) -> Head:
    """The lm_head (the embedding when tied): a bulk product of every logit, then the 64
    highest recomputed in float32 from the file's rows (mapped). With `device_blocks`, a block
    type's bulk is the file's rows alone, for the device to dequantise (to_device), any other
    type's its rows in bf16. In the GGML kernels, where they hold it, the bulk is as
    _ggml_bulk says. In torch's int4 kernel Q4 rows are repacked as they are, others
    requantised to 4 bits: the int4 kernel cannot hold Q6_K's scales per 16 values, Q8_0 would
    be two halves."""
    name = "output.weight" if "output.weight" in file.tensors else "token_embd.weight"
    info = file.tensors[name]
    rows = quant.RowReader(torch.from_numpy(file.raw(name)), info.type, shape.dim)
    if device_blocks:  # a block type dequantised on the device, others (F16...) in bf16
        if info.type in ggml_blocks.BLOCK_BYTES:
            return Head(quant.GGMLLinear(rows.raw, info.type, shape.dim), rows)
        return Head(quant.DenseLinear(rows.all().to(torch.bfloat16)), rows)
    held = _ggml_bulk(file, name, shape.dim, rows, packs) if ggml else None
    if held is not None:
        return Head(held, rows)
    if rows.raw.shape[0] % 16:  # the int4 kernel's rule
        return Head(quant.DenseLinear(rows.all().to(torch.bfloat16)), rows)
    if info.type in quant.PLAIN:

        def build(start: int) -> quant.Int4Linear:
            chunk = torch.from_numpy(file.read(name, start, start + ROW_CHUNK))
            return quant.Int4Linear.from_blocks(chunk, info.type, torch.bfloat16)

    else:

        def build(start: int) -> quant.Int4Linear:
            chunk = torch.from_numpy(file.read(name, start, start + ROW_CHUNK))
            return quant.Int4Linear.requantized(
                quant.dense(chunk, info.type, shape.dim), torch.bfloat16
            )

    vocab = rows.raw.shape[0]
    if packs is None:
        return Head(_join(build, vocab), rows)
    bulk = packs.linear(f"{name} (4-bit bulk)", vocab, shape.dim, lambda: _join(build, vocab))
    return Head(bulk, rows)


def _ggml_bulk(
    file: GGUFFile, name: str, dim: int, rows: quant.RowReader, packs: PackCache | None
) -> quant.GGMLLinear | None:
    """The lm_head's bulk product in the GGML kernels, or None where torch's int4 kernel does
    it better: a 4-bit file's own rows where the kernels hold their type; any other type
    requantised to Q4_K (4.5 bits a value; Qwen2.5-1.5B's Q6_K lm_head: 131 MB a token against
    191) or else to Q4_1 where the kernels hold those, or its own rows (not Q8_0's: twice an
    int4 bulk's bytes). Requantised blocks
    are kept in the pack: seconds of numpy for a large vocabulary."""
    qtype = file.tensors[name].type
    if qtype in quant.PLAIN and ggml_kernel.holds(qtype):
        return quant.GGMLLinear(rows.raw, qtype, dim)
    for target in (quant.Q4_K, quant.Q4_1):
        if ggml_kernel.holds(target) and dim % ggml_blocks.BLOCK_VALUES[target] == 0:
            return _requantized_bulk(file, name, dim, target, packs)
    if ggml_kernel.holds(qtype) and qtype != quant.Q8_0:
        return quant.GGMLLinear(rows.raw, qtype, dim)
    return None


def _requantized_bulk(
    file: GGUFFile, name: str, dim: int, target: int, packs: PackCache | None
) -> quant.GGMLLinear:
    qtype, vocab = file.tensors[name].type, file.tensors[name].shape[0]

    def build() -> quant.GGMLLinear:
        chunks = []
        for start in range(0, vocab, ROW_CHUNK):
            chunk = quant.dense(
                torch.from_numpy(file.read(name, start, start + ROW_CHUNK)), qtype, dim
            )
            chunks.append(quant.GGMLLinear.requantized(chunk, target).raw)
        return quant.GGMLLinear(torch.cat(chunks), target, dim)

    if packs is None:
        return build()
    built = packs.linear(f"{name} (ggml {target} bulk)", vocab, dim, build)
    return cast(quant.GGMLLinear, built)  # the key holds only what build() made


def _frequencies(head_dim: int, base: float) -> torch.Tensor:
    half = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    return 1.0 / (base**half)


def _inv_freq(file: GGUFFile, shape: LlamaShape) -> torch.Tensor:
    inv_freq = _frequencies(shape.head_dim, shape.rope_base)
    if "rope_freqs.weight" in file.tensors:  # Llama 3.1+ long-context factors, per frequency
        factors = file.tensors["rope_freqs.weight"]
        inv_freq = inv_freq / quant.dense(torch.from_numpy(file.read(factors.name)),
                                          factors.type, factors.shape[-1]).reshape(-1)  # fmt: skip
    return inv_freq


def _dense(file: GGUFFile, shape: LlamaShape, names: Iterable[str]) -> torch.Tensor:
    parts = []
    for name in names:
        info = file.tensors[name]
        parts.append(quant.dense(raw_rows(file, shape, name), info.type, info.shape[-1]))
    return torch.cat(parts)


class _Sized(torch.nn.Module):
    """A unit of the fast model's plan: its bytes, as a weight on the meta device."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(size, dtype=torch.uint8, device="meta"), requires_grad=False
        )


def fast_skeleton(file: GGUFFile) -> torch.nn.Module:
    """The fast model as a placement plans it: each decoder layer ("model.layers.N") and the
    head ("lm_head") with the bytes the file gives its weights. The embedding is left out:
    its rows are always read from the mapped file, the few a token looks up."""
    shape = read_shape(file)
    by_layer = [0] * shape.layers
    for name, info in file.tensors.items():
        if name.startswith("blk."):
            by_layer[int(name.split(".")[1])] += info.nbytes
    head = file.tensors.get("output.weight") or file.tensors["token_embd.weight"]
    skeleton = torch.nn.Module()
    skeleton.model = torch.nn.Module()
    skeleton.model.layers = torch.nn.ModuleList(_Sized(size) for size in by_layer)
    skeleton.lm_head = _Sized(head.nbytes)
    return skeleton


def fast_bytes(file: GGUFFile) -> int:
    """What the fast model holds in memory, about: the units of its plan (fast_skeleton)."""
    return sum(weight.numel() for weight in fast_skeleton(file).parameters())
