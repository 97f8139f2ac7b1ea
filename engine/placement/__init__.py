"""Where a model's layers live (GPU, RAM or disk) and what moving their weights costs.

`engine.device_map` reads the user's choice (--device-map, --max-memory) without torch; `plan`
turns it into accelerate's device map, or refuses it in one line before anything loads;
`dispatch` places a transformers model by that map behind accelerate's hooks; `transfer` times
and counts the weights those hooks bring in on every pass; `mapped` places Glassbox's own GGUF
model, whose disk is the mapped file, read back only where the OS dropped its pages. A load
that asks for nothing goes through none of it: no plan, no hooks, no meter.
"""
