"""The GGUF file format with numpy alone: the reader (metadata, tensors as views of the mapped
file) and the GGML block layouts."""
