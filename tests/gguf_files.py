"""Tiny GGUF files written in the test from a random transformers model, the way llama.cpp's
converter writes them (q/k rows permuted for llama, Gemma's norms stored as 1 + w), with the
tensor types asked for."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

Q4_0, Q4_1, Q8_0, F16, F32 = "Q4_0", "Q4_1", "Q8_0", "F16", "F32"
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K = "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"
# gguf cannot quantise K-quants: their blocks are random bytes with f16 scales sized so the
# weights come out about as large as the model's (app/bench/random_blocks.py)
K_QUANT_TYPES = {Q4_K: 12, Q5_K: 13, Q6_K: 14}
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # Qwen3's QK-norm
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}

# Gemma 3's four norms a block and its QK-norm (its ffn_norm is the one before the MLP)
GEMMA_GGUF_NAMES = {
    **GGUF_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(name: str, arch: str = "llama") -> str:
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "lm_head.weight":
        return "output.weight"
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{(GEMMA_GGUF_NAMES if arch == 'gemma3' else GGUF_NAMES)[rest]}"


def permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows for its RoPE layout."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def random_k_quant(data: np.ndarray, kind: str, seed: int = 0) -> np.ndarray:
    """Random `kind` blocks for a [rows, columns] weight, with weights about `data`'s size."""
    from app.bench.random_blocks import random_blocks

    return random_blocks(*data.shape, K_QUANT_TYPES[kind], float(data.std()), seed)


def write_gguf(
    path: Path, model, weights: str = Q4_1, embedding: str = Q8_0, types: dict | None = None
) -> Path:
    """Write `model` (a transformers Llama, Qwen2, Qwen3 or Gemma3ForCausalLM) as a GGUF: 2-D
    weights in `weights` (or in types[suffix] for a tensor named "...suffix", e.g.
    {"attn_v.weight": Q6_K}), the token embedding in `embedding`, norms and biases in F32."""
    import gguf

    config = model.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}[
        config.model_type
    ]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma3":  # llama.cpp reads the layer pattern, local base and scale from code
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "qwen3":  # its head size is its own, not hidden_size / heads
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.float().numpy()
        target = gguf_name(name, arch)
        if arch == "gemma3" and target.endswith("norm.weight"):
            data = data + 1  # llama.cpp's norm_shift: Gemma3RMSNorm scales by 1 + w
        if arch == "llama" and target.endswith("attn_q.weight"):
            data = permute(data, config.num_attention_heads)
        elif arch == "llama" and target.endswith("attn_k.weight"):
            data = permute(data, config.num_key_value_heads)
        kind = F32 if data.ndim == 1 else embedding if target == "token_embd.weight" else weights
        for suffix, chosen in (types or {}).items():
            named = target == suffix or target.endswith("." + suffix)
            kind = chosen if named and data.ndim == 2 else kind
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in K_QUANT_TYPES:
            raw = random_k_quant(data, kind, seed=zlib.crc32(target.encode()))
            writer.add_tensor(target, raw, raw_dtype=qtype)
        elif kind == F32:
            writer.add_tensor(target, data)
        elif kind == F16:
            writer.add_tensor(target, data.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
