"""Glassbox's inference core: load a causal LM, prefill, decode, and observe it.

Pure Python, torch and transformers; never imports Qt. The modules at this level are the
torch-free contract that app/ and ui/ import: `events` (what a generation yields), `settings`
(what a load or a reply asks for), `serialize`, `token_labels`, `kv_formula` and `device_map`.
The packages below hold the parts, each importing only those beneath it (an import-linter
`layers` contract): generate > load > step, placement, text > measure > model > weights >
gguf, disk.
"""
