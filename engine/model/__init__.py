"""Model definitions: Glassbox's own llama and gemma forwards, the KV buffer, the attention
probe's hooks, one decoder interface over them and transformers' models, and the builders
from a GGUF (the fast model and the transformers reference)."""
