"""Whether a model fits where it was asked to run, checked before anything is read, and what
a load that ran out of memory anyway proposes instead: the placement that would fit
(engine/placement/plan.py's fit_proposal), carried by the ModelLoadError as `fits_as`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from engine.gguf.reader import GGUFFile
from engine.load.loaded import ModelLoadError
from engine.model.fast_builder import fast_bytes, fast_skeleton
from engine.model.gguf_shape import read_shape
from engine.model.reference import exact_bytes, exact_skeleton
from engine.placement.plan import fit_proposal


def check_fast_fits(file: GGUFFile, name: str, device: torch.device) -> None:
    """Refuse a fast load its RAM cannot hold, proposing the RAM cap that would fit."""
    skeleton = functools.partial(fast_skeleton, file)
    proposal = fit_proposal(name, fast_bytes(file), device, skeleton=skeleton, mapped=True)
    if proposal is not None:
        raise ModelLoadError(proposal.line, proposal)


def check_exact_fits(file: GGUFFile, name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a dequantised load the device cannot hold, proposing the placement that would."""
    needed, layers = exact_bytes(file, dtype), read_shape(file).layers
    proposal = fit_proposal(name, needed, device, layers, lambda: exact_skeleton(file, dtype))
    if proposal is not None:
        raise ModelLoadError(proposal.line, proposal)


def out_of_memory(
    name: str, needed: int, device: torch.device, skeleton: Callable[[], torch.nn.Module],
    mapped: bool = False,
) -> ModelLoadError:  # fmt: skip
    """The error of a load that ran out of memory: the placement that would fit, if one would
    (`mapped`: the fast model's, whose disk is the mapped file)."""
    proposal = fit_proposal(name, needed, device, skeleton=skeleton, mapped=mapped)
    if proposal is None:
        return ModelLoadError(f"{name} ran out of memory while loading on {device}.")
    return ModelLoadError(proposal.line, proposal)
