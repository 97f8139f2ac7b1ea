"""Tiny random-weight models of four architectures, sharing the bundled tokenizer."""

from __future__ import annotations

TINY_ARCHITECTURES = ("llama", "qwen2", "gpt2", "gemma3")


def tiny_config(architecture: str, **overrides):
    """A few-layer config of the given shape with the bundled tokenizer's vocabulary."""
    from transformers import Gemma3TextConfig, GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if architecture == "llama":  # grouped-query attention: 4 query heads share 2 KV heads
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=2, **common)  # fmt: skip
    elif architecture == "qwen2":
        config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, **common)  # fmt: skip
    elif architecture == "qwen3":  # QK-norm, and a head size that is not hidden / heads
        config = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                             **common)  # fmt: skip
    elif architecture == "gpt2":  # multi-head attention, learned positions
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **common)
    elif architecture == "gemma3":  # a sliding-window layer, then a global one
        config = Gemma3TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  sliding_window=8, layer_types=["sliding_attention",
                                  "full_attention"], **common)  # fmt: skip
    else:
        raise ValueError(architecture)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def make_tiny(tokenizer, architecture: str, seed: int = 0, attn: str | None = None, **overrides):
    """A random-weight model wrapped like a loaded one (attn="eager" for references)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.load.loader import prepare

    torch.manual_seed(seed)
    config = tiny_config(architecture, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if attn is not None:
        model.set_attn_implementation(attn)
        return model
    return prepare(model, tokenizer, name=f"tiny-{architecture}", source="memory")
