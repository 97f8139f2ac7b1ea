"""Load a causal LM and its tokenizer from the bundled GGUF, a hub id, a folder or a .gguf file.

`load_model` chooses the request's route once (engine/load/route.py), runs that route's module
top to bottom (engine/load/gguf_fast.py, gguf_exact.py, pretrained.py), then finishes every
model alike: its chat format, and the machine's peak speeds measured once. Every failure
becomes a `ModelLoadError` whose message a user can act on (engine/load/loaded.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from engine.disk.cache_folder import default_cache_dir
from engine.load import gguf_exact, gguf_fast, pretrained
from engine.load.loaded import (
    LoadedModel,
    ModelLoadError,
    Progress,
    describe,
    describe_fast,
    instruction_tuned,
    measure_peaks,
    model_architecture,
    prepare,
    with_chat_format,
)
from engine.load.placed import place
from engine.load.route import (
    GGUF_EXACT,
    GGUF_FAST,
    GGUF_OTHER,
    PRETRAINED,
    Route,
    bundled_gguf_path,
    choose,
    resolve,
)
from engine.load.tokenizer import gguf_tokenizer
from engine.settings import LoadRequest

__all__ = [
    "LoadedModel",
    "ModelLoadError",
    "Progress",
    "bundled_gguf_path",
    "describe",
    "describe_fast",
    "gguf_tokenizer",
    "instruction_tuned",
    "load_model",
    "model_architecture",
    "place",
    "prepare",
    "resolve",
    "with_chat_format",
]

ROUTES: dict[str, Callable[[Route, Progress], LoadedModel]] = {
    GGUF_FAST: gguf_fast.load,
    GGUF_EXACT: gguf_exact.load,
    GGUF_OTHER: gguf_exact.load_other,
    PRETRAINED: pretrained.load,
}


def load_model(
    request: LoadRequest,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load what `request.spec` names onto the requested device, ready for a ChatSession."""
    report = progress or (lambda stage, fraction: None)
    route = choose(request, writable(cache_dir or default_cache_dir()), report)
    loaded = ROUTES[route.kind](route, report)
    guess = route.file is not None and instruction_tuned(Path(route.location))
    loaded = with_chat_format(loaded, guess, request.chat_template)
    measure_peaks(route.device, loaded.info.dtype, report)
    report("Ready", 1.0)
    return loaded


def writable(folder: Path) -> Path:
    """The cache folder, made if missing; a ModelLoadError where it cannot be made or written
    (a load writes its tokenizer, packs and kernels there)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        problem = error.strerror or str(error)
    else:
        if os.access(folder, os.W_OK):
            return folder
        problem = "not writable"
    raise ModelLoadError(
        f"The cache folder {folder} cannot be used ({problem}): set GLASSBOX_CACHE_DIR to a"
        " folder you can write."
    )
