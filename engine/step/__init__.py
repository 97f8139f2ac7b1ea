"""The fast one-token decode steps: the CPU's AOTInductor-compiled step and the CUDA graph
step, over the same model and KV buffer as the eager forward."""
