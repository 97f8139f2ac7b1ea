"""The benchmarks (`glassbox bench`), beside the product: they measure the window and the
engine through the seams the app itself uses (the client's batched events, a Generate that
keeps its events in the engine), never through hooks of their own.

  command         the `bench` subcommand and its flags
  speed           decode speed, prefill and long context, against llama.cpp where installed
  llama_cpp_peer  llama.cpp (llama-cpp-python) run on the same GGUF, prompt and settings
  gpu             the CUDA path against transformers' generate (static and dynamic cache)
  placement       a placed model against the same model in memory
  synthetic       a stand-in engine yielding real events with a model's shapes, at any rate
  stall           how long the window's event loop stalls while a long reply streams into it
  window          what the real window on the engine process costs the model it shows
  stepping        a teacher's stepping: how fast each Next token reaches every panel
  loop            running the GUI's event loop until something happened
"""
