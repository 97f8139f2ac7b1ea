"""Compiled steps built once for the whole run (minutes each on a small machine): the tiny
Llama's, and the bundled model's (kept in the test cache between runs)."""

from __future__ import annotations

import pytest
import torch

from engine.disk.cache_folder import default_cache_dir
from engine.step import compiled as compiled_decode
from tests.engine.model.test_fast import hf_model
from tests.engine.step.compiling import build, needs_a_compiler
from tests.gguf_files import Q4_1, Q8_0, write_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    return write_gguf(path, hf_model("llama"), Q4_1, Q8_0)


@pytest.fixture(scope="session")
def compiled(tiny_gguf, tmp_path_factory):
    """(the tiny model with its compiled step attached, the saved step's path)."""
    needs_a_compiler()
    model = build(tiny_gguf)
    assert compiled_decode.refusal(model) is None
    path = tmp_path_factory.mktemp("compiled") / "llama.pt2"
    compiled_decode.compile_to(model, path)
    model.decode_step = compiled_decode.load(path, model)  # from the file, as a later start
    return model, path


@pytest.fixture(scope="session")
def bundled_compiled():
    """The bundled model in fast precision with its compiled step (compiled once per cache)."""
    needs_a_compiler()
    from engine.load.loader import bundled_gguf_path, load_model
    from engine.settings import LoadRequest

    loaded = load_model(LoadRequest(spec="bundled", device="cpu", precision="fast", compiled=False))
    model = loaded.model
    gguf = bundled_gguf_path()
    folder = default_cache_dir() / "compiled"
    path = compiled_decode.artifact_path(folder, gguf.stem, "tests", torch.get_num_threads(), model)
    if not path.exists():
        compiled_decode.compile_to(model, path)
    model.decode_step = compiled_decode.load(path, model)
    return loaded
