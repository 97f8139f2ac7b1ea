"""Random-weight GGUFs in the exact layout of real ones: `glassbox bench --model shape:NAME`.

A benchmark of speed needs a model's layout, not its knowledge: the same tensor names, shapes
and GGML types per tensor (the mixed Q4_K/Q6_K/Q5_0/Q8_0 of a Q4_K_M file included) and the
metadata the engine and transformers read (architecture, sizes, heads, RoPE, norms, context,
chat template). Such a file is built here from nothing, so a GPU machine without network or
model files can measure what the real model would run at. The tokenizer is a stand-in of the
real vocabulary size with the real special tokens at their ids (app/bench/stand_in_tokenizer).

Each shape is written once into the cache folder (engine/disk/cache_folder.py) and reused.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from app.bench import stand_in_tokenizer
from app.bench.random_blocks import SCALE_FIELDS, random_blocks
from app.bench.stand_in_tokenizer import TokenizerShape
from engine.disk.cache_folder import default_cache_dir
from engine.gguf.blocks import Q4_1, Q4_K, Q5_0, Q6_K, Q8_0

PREFIX = "shape:"  # how --model names a shape
F32 = 0
VERSION = 3  # part of the file's name: a change to what is written writes the file anew
WEIGHT_STD = 0.02
TEMPLATES = Path(__file__).with_name("templates")


@dataclass(frozen=True)
class Shape:
    """One real GGUF's layout. Per-layer tensor types: `types[suffix]`, except the layers
    listed in `more_bits[suffix]`, which get the second type (llama.cpp's Q4_K_M gives some
    layers' attn_v and ffn_down more bits)."""

    name: str
    real_file: str  # the real file's name in the models folder, for the tests' comparison
    architecture: str
    metadata: dict[str, int | float | str | bool]  # "{arch}." keys without the prefix
    vocab: int
    layers: int
    head_dim: int
    types: dict[str, int]  # 2-D tensors: token_embd, output (absent: tied), per-layer suffixes
    tokenizer: TokenizerShape
    more_bits: dict[str, tuple[int, frozenset[int]]] = field(default_factory=dict)
    chat_template: str = ""  # a file in templates/, or none (the engine then picks by arch)
    finetune: str = ""  # general.finetune: the engine guesses a template only for a tuned model
    file_type: int = 15  # general.file_type: 15 is MOSTLY_Q4_K_M

    def stated(self, key: str) -> int:
        """A size the metadata states (e.g. "embedding_length"), read rather than said twice."""
        return int(self.metadata[key])


_Q4_K_M_QWEN = frozenset({0, 1, 5, 6, 7, 8, 9, 10, 13, 16, 19, 21, 24, 27})
_Q4_K_M_18 = frozenset({0, 1, 4, 7, 10, 13, 15, 16, 17})  # llama.cpp's use_more_bits(i, 18)
_CHATML = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}

SHAPES = {
    "bundled": Shape(
        name="bundled",
        real_file="",  # the bundled package's file (engine.load.loader.bundled_gguf_path)
        architecture="llama",
        metadata={
            "context_length": 8192,
            "embedding_length": 576,
            "feed_forward_length": 1536,
            "attention.head_count": 9,
            "attention.head_count_kv": 3,
            "rope.freq_base": 100000.0,
            "attention.layer_norm_rms_epsilon": 1e-5,
            "vocab_size": 49152,
            "rope.dimension_count": 64,
        },
        vocab=49152,
        layers=30,
        head_dim=64,
        types={"token_embd": Q8_0, **dict.fromkeys(("attn_q", "attn_k", "attn_v"), Q4_1)}
        | dict.fromkeys(("attn_output", "ffn_gate", "ffn_up", "ffn_down"), Q4_1),
        tokenizer=TokenizerShape(
            model="gpt2",
            pre="smollm",
            special={index: token for token, index in _CHATML.items()},
            ids={"bos": 1, "eos": 2, "unknown": 0, "padding": 2},
            flags={"add_space_prefix": False, "add_bos_token": False},
        ),
        chat_template="smollm2.jinja",
        file_type=3,  # MOSTLY_Q4_1
        finetune="8k-lc100k-mix1-ep2",
    ),
    "qwen2.5-1.5b": Shape(
        name="qwen2.5-1.5b",
        real_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        architecture="qwen2",
        metadata={
            "context_length": 32768,
            "embedding_length": 1536,
            "feed_forward_length": 8960,
            "attention.head_count": 12,
            "attention.head_count_kv": 2,
            "rope.freq_base": 1000000.0,
            "attention.layer_norm_rms_epsilon": 1e-6,
        },
        vocab=151936,
        layers=28,
        head_dim=128,
        types={"token_embd": Q4_K, "output": Q6_K}
        | dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output"), Q4_K)
        | dict.fromkeys(("ffn_gate", "ffn_up", "ffn_down"), Q4_K),
        more_bits={"attn_v": (Q6_K, _Q4_K_M_QWEN), "ffn_down": (Q6_K, _Q4_K_M_QWEN)},
        tokenizer=TokenizerShape(
            model="gpt2",
            pre="qwen2",
            special={151643 + index: token for token, index in _CHATML.items()},
            ids={"eos": 151645, "padding": 151643, "bos": 151643},
            flags={"add_bos_token": False},
        ),
        chat_template="qwen2.5-coder.jinja",
        finetune="Instruct-GGUF",
    ),
    "gemma-3-270m": Shape(
        name="gemma-3-270m",
        real_file="gemma-3-270m-q4_k_m.gguf",
        architecture="gemma3",
        metadata={
            "context_length": 32768,
            "embedding_length": 640,
            "feed_forward_length": 2048,
            "attention.head_count": 4,
            "attention.layer_norm_rms_epsilon": 1e-6,
            "attention.key_length": 256,
            "attention.value_length": 256,
            "rope.freq_base": 1000000.0,
            "attention.sliding_window": 512,
            "attention.head_count_kv": 1,
        },
        vocab=262144,
        layers=18,
        head_dim=256,
        types={"token_embd": Q8_0, "attn_output": Q4_K, "ffn_down": Q4_K}
        | dict.fromkeys(("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"), Q5_0),
        more_bits={"attn_v": (Q8_0, _Q4_K_M_18), "ffn_down": (Q6_K, _Q4_K_M_18)},
        tokenizer=TokenizerShape(
            model="llama",
            pre="default",
            special={0: "<pad>", 1: "<eos>", 2: "<bos>", 3: "<unk>", 4: "<mask>"}
            | {105: "<start_of_turn>", 106: "<end_of_turn>"},
            ids={"bos": 2, "eos": 1, "unknown": 3, "padding": 0},
            flags={
                "add_bos_token": True,
                "add_sep_token": False,
                "add_eos_token": False,
                "add_space_prefix": False,
            },
            byte_tokens_at=238,
        ),
    ),
}


# The bundled model's vocabulary, tokenizer and types around one 64-wide layer: a forward that
# costs almost nothing, so its decode rate is the per-token loop's own cost (sampling, probes,
# events, detokenising) on any machine. No real file has this layout.
LOOP = replace(
    SHAPES["bundled"],
    name="loop",
    metadata=SHAPES["bundled"].metadata
    | {
        "embedding_length": 64,
        "feed_forward_length": 128,
        "attention.head_count": 1,
        "attention.head_count_kv": 1,
    },
    layers=1,
)


def shape_named(spec: str) -> Shape | None:
    """The shape `spec` names ("shape:NAME"), None for any other model spec; an unknown
    NAME is a ValueError that lists the known ones."""
    if not spec.startswith(PREFIX):
        return None
    name = spec.removeprefix(PREFIX)
    known = SHAPES | {LOOP.name: LOOP}
    if name not in known:
        raise ValueError(f"no model shape {name!r}; known: {', '.join(known)}")
    return known[name]


def layout(shape: Shape) -> dict[str, tuple[tuple[int, ...], int]]:
    """Every tensor's name -> (shape in numpy order, rows first; GGML type), in file order."""
    h, f = shape.stated("embedding_length"), shape.stated("feed_forward_length")
    q = shape.stated("attention.head_count") * shape.head_dim
    kv = shape.stated("attention.head_count_kv") * shape.head_dim
    tensors: dict[str, tuple[tuple[int, ...], int]] = {
        "token_embd.weight": ((shape.vocab, h), shape.types["token_embd"]),
        "output_norm.weight": ((h,), F32),
    }
    if "output" in shape.types:
        tensors["output.weight"] = ((shape.vocab, h), shape.types["output"])
    matrices = {
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_gate": (f, h),
        "ffn_up": (f, h),
        "ffn_down": (h, f),
    }
    vectors = {"attn_norm": h, "ffn_norm": h}
    if shape.architecture == "qwen2":
        vectors |= {"attn_q.bias": q, "attn_k.bias": kv, "attn_v.bias": kv}
    if shape.architecture == "gemma3":
        vectors |= {"attn_q_norm": shape.head_dim, "attn_k_norm": shape.head_dim}
        vectors |= {"post_attention_norm": h, "post_ffw_norm": h}
    for layer in range(shape.layers):
        for suffix, dims in matrices.items():
            tensors[f"blk.{layer}.{suffix}.weight"] = (dims, _layer_type(shape, suffix, layer))
        for suffix, size in vectors.items():
            name = suffix if suffix.endswith(".bias") else f"{suffix}.weight"
            tensors[f"blk.{layer}.{name}"] = ((size,), F32)
    return tensors


def _layer_type(shape: Shape, suffix: str, layer: int) -> int:
    more, layers = shape.more_bits.get(suffix, (0, frozenset()))
    return more if layer in layers else shape.types[suffix]


def shape_file(shape: Shape, cache_dir: Path | None = None) -> Path:
    """The shape's GGUF in the cache folder, written there first if it is not there yet."""
    path = (cache_dir or default_cache_dir()) / "shapes" / f"{shape.name}-{VERSION}.gguf"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(f"{path.name}.{os.getpid()}.partial")
        try:
            write(shape, staging)
            staging.replace(path)  # whole or absent: a write cut short is never read
        finally:
            staging.unlink(missing_ok=True)
    return path


def write(shape: Shape, path: Path, with_tensors: bool = True) -> None:
    """Write the shape's GGUF to `path`, one tensor at a time (the largest is 300 MB); without
    `with_tensors`, its metadata alone (what its tokenizer is read from)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), shape.architecture)
    for key, value in metadata(shape).items():
        _add(writer, key, value)
    tensors = layout(shape) if with_tensors else {}
    for name, (dims, qtype) in tensors.items():
        nbytes = _nbytes(dims, qtype)
        byte_shape = (*dims[:-1], nbytes // max(1, int(np.prod(dims[:-1]))))
        if qtype == F32:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), nbytes)
        else:
            raw = gguf.GGMLQuantizationType(qtype)
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in _tensor_data(shape, tensors):
        writer.write_tensor_data(data)
    writer.close()


def metadata(shape: Shape) -> dict[str, Any]:
    """Every metadata key the shape's file holds (but general.architecture) and its value."""
    keys: dict[str, Any] = {
        "general.name": f"{shape.name} shape (random weights)",
        "general.file_type": shape.file_type,
        f"{shape.architecture}.block_count": shape.layers,
    }
    if shape.finetune:
        keys["general.finetune"] = shape.finetune
    keys |= {f"{shape.architecture}.{key}": value for key, value in shape.metadata.items()}
    keys |= stand_in_tokenizer.metadata(shape.tokenizer, shape.vocab)
    if shape.chat_template:
        keys["tokenizer.chat_template"] = (TEMPLATES / shape.chat_template).read_text()
    return keys


def _add(writer: Any, key: str, value: Any) -> None:
    if isinstance(value, bool):  # before int: a bool is an int too
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)


def _nbytes(dims: tuple[int, ...], qtype: int) -> int:
    from engine.gguf.blocks import BLOCK_BYTES, BLOCK_VALUES

    values = int(np.prod(dims))
    return values * 4 if qtype == F32 else values // BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype]


def _tensor_data(
    shape: Shape, tensors: dict[str, tuple[tuple[int, ...], int]]
) -> Iterator[np.ndarray]:
    """Each tensor's random data, seeded by its name: the same file on every machine."""
    for name, (dims, qtype) in tensors.items():
        seed = zlib.crc32(f"{shape.name}/{name}".encode())
        if qtype in SCALE_FIELDS:
            yield random_blocks(dims[0], dims[1], qtype, WEIGHT_STD, seed)
            continue
        noise = np.random.default_rng(seed).normal(0, WEIGHT_STD, dims).astype(np.float32)
        # norms scale by about 1 (Gemma's file stores 1 + w, so 1 there too); biases are small
        yield noise if name.endswith(".bias") else noise + np.float32(1)
