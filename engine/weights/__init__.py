"""GGUF weights as torch modules: the linear layers over each block type, the C++ GGML kernels
that multiply the file's own blocks, and the cache of repacked weights."""
