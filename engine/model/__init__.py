"""Model definitions: Glassbox's own llama and gemma forwards, the KV buffer, the attention
probe's hooks, one decoder interface over them and transformers' models, and the builders
from a GGUF (gguf_shape.py what both read, fast_builder.py the fast model, reference.py the
transformers reference)."""
