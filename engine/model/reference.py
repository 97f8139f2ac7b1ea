"""The transformers reference of a GGUF: the same model as transformers' Llama, Qwen2, Qwen3 or
Gemma3 classes, every weight dequantised from the file (what the exact precision runs and what
the fast model is tested against)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.gguf.reader import GGUFFile
from engine.model.gguf_shape import TensorProgress, Unsupported, raw_rows, read_shape
from engine.model.llama import LlamaShape
from engine.weights import linear as quant

if TYPE_CHECKING:
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        PreTrainedModel,
        Qwen2Config,
        Qwen3Config,
    )

HF_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3's (and Gemma 3's) QK-norm
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


# Gemma 3 names its norms after where they sit: its ffn_norm is the one before the feed-forward.
GEMMA_HF_NAMES = {
    **HF_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}


def hf_name(name: str, architecture: str = "llama") -> str | None:
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name.startswith("blk."):
        _, index, rest = name.split(".", 2)
        names = GEMMA_HF_NAMES if architecture == "gemma3" else HF_NAMES
        if rest in names:
            return f"model.layers.{index}.{names[rest]}"
    return None


def hf_config(file: GGUFFile) -> LlamaConfig | Qwen2Config | Qwen3Config | Gemma3TextConfig:
    """A transformers config for the GGUF's model (Llama, Qwen2, Qwen3 or Gemma3 classes)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    shape = read_shape(file)
    if shape.architecture == "gemma3":
        return _gemma_config(file, shape)
    if "rope_freqs.weight" in file.tensors:
        raise Unsupported("Llama 3 RoPE frequency factors in the transformers reference")
    classes: dict[str, type[LlamaConfig] | type[Qwen2Config] | type[Qwen3Config]] = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
    }
    config_class = classes[shape.architecture]
    # head_dim and rope_theta go through the configs' **kwargs (read into rope_parameters);
    # their typed signatures leave them out.
    config: LlamaConfig | Qwen2Config | Qwen3Config = config_class(  # type: ignore[call-arg]
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.eps,
        rope_theta=shape.rope_base, max_position_embeddings=shape.context,
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=file.get("tokenizer.ggml.padding_token_id"),
        architectures=[config_class.__name__.replace("Config", "ForCausalLM")],
    )  # fmt: skip
    return config


def _gemma_config(file: GGUFFile, shape: LlamaShape) -> Gemma3TextConfig:
    """Gemma3TextConfig of the shape read_shape found: its layer types, window, both RoPE bases
    and q·k scale spelled out, rather than left to the config's defaults."""
    from transformers import Gemma3TextConfig

    sliding = set(shape.sliding_layers)
    kinds = ["sliding_attention" if i in sliding else "full_attention" for i in range(shape.layers)]
    rope = {
        "full_attention": {"rope_type": "default", "rope_theta": shape.rope_base},
        "sliding_attention": {"rope_type": "default", "rope_theta": shape.local_rope_base},
    }
    return Gemma3TextConfig(
        vocab_size=shape.vocab, hidden_size=shape.dim, intermediate_size=shape.ffn,
        num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads, head_dim=shape.head_dim, rms_norm_eps=shape.eps,
        rope_parameters=rope, max_position_embeddings=shape.context,
        sliding_window=shape.sliding_window, layer_types=kinds,
        query_pre_attn_scalar=round(shape.query_scale**-2),
        tie_word_embeddings="output.weight" not in file.tensors,
        bos_token_id=file.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=file.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=file.get("tokenizer.ggml.padding_token_id"),
        architectures=["Gemma3ForCausalLM"],
    )  # fmt: skip


def exact_skeleton(file: GGUFFile, dtype: torch.dtype) -> PreTrainedModel:
    """The transformers model of the GGUF on the meta device: its shapes, no weights (what a
    placement is planned on before anything is dequantised)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(hf_config(file), dtype=dtype)  # type: ignore[no-untyped-call]
    return model


def exact_bytes(file: GGUFFile, dtype: torch.dtype) -> int:
    """What the dequantised weights take in `dtype` (an estimate: tensors the file holds)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(info.shape) * size for info in file.tensors.values())


# Takes a dequantised weight (its transformers name) out of RAM, e.g. to disk; False: keep it.
WeightSink = Callable[[str, torch.Tensor], bool]


def build_exact(
    file: GGUFFile,
    dtype: torch.dtype,
    progress: TensorProgress | None = None,
    sink: WeightSink | None = None,
) -> PreTrainedModel:
    """The transformers model with every weight dequantised to `dtype` (no copy on disk).

    `sink` may take each weight as it is made (a placement writing it to disk): a weight it
    takes stays on the meta device, so a model larger than RAM never sits in it whole."""
    config = hf_config(file)
    shape = read_shape(file)
    state = {}
    taken: set[str] = set()
    names = list(file.tensors)
    gemma = shape.architecture == "gemma3"
    for done, name in enumerate(names, 1):
        target = hf_name(name, shape.architecture)
        if target == "lm_head.weight" and config.tie_word_embeddings:
            target = None  # the head is the embedding
        if target is not None:
            info = file.tensors[name]
            rows = raw_rows(file, shape, name)
            weight = quant.dense(rows, info.type, info.shape[-1]).reshape(info.shape)
            if gemma and name.endswith("norm.weight"):  # the file's 1 + w, Gemma3RMSNorm's w
                weight = weight - 1
            weight = weight.to(dtype, copy=True)
            if sink is not None and sink(target, weight):
                taken.add(target)
            else:
                state[target] = weight
        if progress is not None:
            progress(done, len(names))
    model = exact_skeleton(file, dtype)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta and n not in taken]
    if missing:
        raise Unsupported(f"the GGUF lacks {', '.join(missing[:3])}")
    # The rotary tables are buffers computed at construction, which happened on the meta device.
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    if gemma:  # so is the embedding's √dim, made in the model's dtype as transformers does
        scale = torch.tensor(config.hidden_size**0.5, dtype=dtype)
        model.model.embed_tokens.embed_scale = scale
    exact: PreTrainedModel = model.eval()  # type: ignore[no-untyped-call]
    return exact
