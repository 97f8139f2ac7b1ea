"""What the compiled step's tests share: whether a step can be built here, and a fast model
built from a GGUF file."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine.gguf.reader import GGUFFile
from engine.model import fast_builder
from engine.model.llama import GGUFLlama
from engine.step import compiled as compiled_decode


def needs_a_compiler() -> None:
    """Inductor builds the step with the C++ compiler ($CXX, else g++); without one the app
    decodes eagerly (test_a_failed_compile...), and the step cannot be tested here."""
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler to build the compiled step with")
    if not compiled_decode.can_save_compiled():
        pytest.skip(f"torch {torch.__version__} cannot save a compiled step")


def build(path) -> GGUFLlama:
    return fast_builder.build_fast(GGUFFile(path))
