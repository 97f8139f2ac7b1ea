"""The benchmarks (`glassbox bench`), beside the product: they measure the window and the
engine through the seams the app itself uses (the client's batched events, a Generate that
keeps its events in the engine), never through hooks of their own.

  command  the `bench` subcommand: decode speed, prefill, long context (engine.benchmark)
  stall    how long the window's event loop stalls while a long reply streams into it
  window   what the real window on the engine process costs the model it shows
  loop     running the GUI's event loop until something happened
"""
