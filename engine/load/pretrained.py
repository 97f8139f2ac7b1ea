"""The `pretrained` route: a hub id or a folder, through transformers at exact precision.

A checkpoint that is not a causal language model is refused from its config alone. Placed,
the plan is made on the model's skeleton (its shapes on the meta device, from the config) and
from_pretrained streams each weight to its place, so RAM never holds more than the plan puts
there. Out of memory, the load proposes the placement that would fit (engine/load/fits.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.load.fits import out_of_memory
from engine.load.loaded import LoadedModel, ModelLoadError, Progress, finish, prepare, short
from engine.load.placed import placement_note, plan, with_placement
from engine.load.route import Route
from engine.placement import plan as placement_plan
from engine.placement.dispatch import finish as finish_placement
from engine.placement.dispatch import forget_with, offload_folder
from engine.placement.plan import DeviceMapDict

if TYPE_CHECKING:  # transformers is imported only on the paths that need it
    from transformers import PreTrainedModel

# Checkpoint classes of encoder heads (see check_causal).
ENCODER_HEADS = (
    "ForMaskedLM",
    "ForSequenceClassification",
    "ForTokenClassification",
    "ForQuestionAnswering",
    "ForMultipleChoice",
    "ForNextSentencePrediction",
)


def load(route: Route, report: Progress) -> LoadedModel:
    """transformers' model and tokenizer, placed as the request says."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location, request, local = route.location, route.request, route.source != "hub"
    check_causal(location, local)
    skeleton = _skeleton(location, route.dtype, local) if request.placed else None
    mapping = plan(skeleton, request, route.device) if skeleton is not None else None
    placing: dict[str, object] = {}
    if mapping is not None:
        folder = offload_folder(route.cache)
        placing = {"device_map": _transformers_places(mapping), "offload_folder": str(folder)}
    try:
        report("Loading the tokenizer", 0.3)
        tokenizer = AutoTokenizer.from_pretrained(location, local_files_only=local)
        report("Loading the weights", 0.5)
        model = AutoModelForCausalLM.from_pretrained(
            location, dtype=route.dtype, local_files_only=local, **placing
        )
    except (torch.OutOfMemoryError, MemoryError):
        skeleton = skeleton or _skeleton(location, route.dtype, local)
        needed = sum(unit.bytes for unit in placement_plan.units(skeleton))
        raise out_of_memory(location, needed, route.device, lambda: skeleton) from None
    except Exception as error:
        raise ModelLoadError(f"Could not load {location}: {short(error)}") from None
    if mapping is None or skeleton is None:
        return finish(model, tokenizer, location, route.source, route.device, report)
    forget_with(model, folder)
    units = placement_plan.units(skeleton)
    placed = finish_placement(model, units, mapping, route.device, placement_note(request))
    return with_placement(prepare(model, tokenizer, name=location, source=route.source), placed)


def check_causal(location: str, local: bool) -> None:
    """Refuse a checkpoint that does not generate text, from its config."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(location, local_files_only=local)
    except Exception as error:
        where = "this folder" if local else "the model hub (is the network reachable?)"
        raise ModelLoadError(
            f"Could not read the model config of {location} from {where}: {short(error)}"
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


def _skeleton(location: str, dtype: torch.dtype, local: bool) -> PreTrainedModel:
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
