"""What every route ends with: a LoadedModel (the model, its tokenizer and their description),
or a ModelLoadError whose message a user can act on; and the steps the routes share to get
there (a transformers model put in inference mode behind the attention probe, the chat format,
the machine's peak speeds measured once)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

import torch

from engine.device_map import Proposal
from engine.events import ModelInfo
from engine.gguf.reader import GGUFError, GGUFFile
from engine.measure import peaks
from engine.model import attention_probe
from engine.model.gguf_shape import TensorProgress
from engine.placement.mapped import MappedMeter
from engine.placement.transfer import TransferMeter
from engine.step.compiled import Attacher
from engine.step.static import StepState
from engine.text import chat_format
from engine.text.tokenizer import LeanTokenizer

if TYPE_CHECKING:  # transformers is imported only on the paths that need it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from engine.model.llama import GGUFLlama

log = logging.getLogger(__name__)

# A load's progress: the stage's words and the fraction done.
Progress = Callable[[str, float], None]


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


def finish(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    name: str,
    source: str,
    device: torch.device,
    report: Progress,
) -> LoadedModel:
    """A transformers model loaded in RAM, moved to its device and prepared."""
    report("Moving to " + str(device), 0.95)
    model.to(device)  # type: ignore[arg-type]  # transformers' wrapper on .to loses its self
    return prepare(model, tokenizer, name=name, source=source)


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


AnyTokenizer = TypeVar("AnyTokenizer", "PreTrainedTokenizerBase", LeanTokenizer)


def with_pad(tokenizer: AnyTokenizer) -> AnyTokenizer:
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


def measure_peaks(device: torch.device, dtype: str, report: Progress) -> None:
    """The roofline's ceilings for this machine, measured once and kept (seconds): as a stage of
    the load, so a first start shows what it waits for instead of pausing after "Ready"."""
    if peaks.known(device, dtype):
        return
    report("Measuring this machine's peak speeds (once)", 0.98)
    peaks.peaks_or_none(device, dtype)


def per_tensor(report: Progress, stage: str, start: float, end: float) -> TensorProgress:
    """A per-tensor callback that reports the stage with a rising fraction (about 1% steps)."""
    last = [-1.0]

    def tensor_done(done: int, total: int) -> None:
        fraction = start + (end - start) * done / max(total, 1)
        if fraction - last[0] >= 0.01 or done == total:
            last[0] = fraction
            report(f"{stage} ({done}/{total} tensors)", fraction)

    return tensor_done


def short(error: BaseException) -> str:
    """An error's first line, at most 300 characters, for a message a user reads."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]
