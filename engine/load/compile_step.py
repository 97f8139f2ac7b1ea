"""`python -m engine.load.compile_step GGUF PACKAGE CACHE_DIR`: compile the decode step of a GGUF
into PACKAGE, what compiled_decode.Attacher runs in the background when none is kept.

The entry point lives apart from engine/step/compiled.py because it loads the model
(engine/load/loader.py), and the fast route (engine/load/gguf_fast.py) attaches compiled steps:
one module for both would import itself in a circle. It holds the package's build lock
(engine/disk/build_lock.py) while it works, so a second launch waits for this build instead of
starting its own.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch

from engine.disk import build_lock
from engine.load.loader import load_model
from engine.model.llama import GGUFLlama
from engine.settings import LoadRequest
from engine.step.compiled import can_save_compiled, compile_to, refusal


def main(argv: Sequence[str] | None = None) -> int:
    """Compile the decode step of a GGUF in fast precision into `path`, unless a build this
    one waited for made it meanwhile."""
    parser = argparse.ArgumentParser(prog="python -m engine.load.compile_step")
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("path", type=Path, help="where to save the compiled step")
    parser.add_argument("cache_dir", type=Path, help="the cache folder the model loads from")
    parser.add_argument("--threads", type=int, help="torch threads the step will run with")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with build_lock.building(args.path) as missing:
        return compile_gguf(args.gguf, args.path, args.cache_dir) if missing else 0


def compile_gguf(gguf: str, path: Path, cache_dir: Path) -> int:
    request = LoadRequest(gguf, precision="fast", compiled=False)
    model = cast(GGUFLlama, load_model(request, cache_dir=cache_dir).model)
    reason = refusal(model)
    if reason is None and not can_save_compiled():
        reason = f"torch {torch.__version__} cannot save a compiled step"
    if reason is not None:
        print(f"not compiled: {reason}", file=sys.stderr)
        return 2
    compile_to(model, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
