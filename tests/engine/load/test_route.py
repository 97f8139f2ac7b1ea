"""The route a LoadRequest takes, chosen once before anything is loaded: which module runs it,
and the refusals made before any weight is read."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.load import route
from engine.load.loaded import ModelLoadError
from engine.load.route import GGUF_EXACT, GGUF_FAST, GGUF_OTHER, PRETRAINED, choose
from engine.settings import LoadRequest


def chosen(tmp_path: Path, **request: str) -> route.Route:
    stages: list[str] = []
    taken = choose(LoadRequest(**request), tmp_path, lambda stage, fraction: stages.append(stage))
    assert stages == ["Finding the model"]
    return taken


@pytest.mark.bundled
def test_the_bundled_model_runs_fast_on_the_cpu_unless_asked_exact(tmp_path):
    auto = chosen(tmp_path, spec="bundled", device="cpu")
    assert (auto.kind, auto.source, auto.device) == (GGUF_FAST, "bundled", torch.device("cpu"))
    assert auto.name == route.BUNDLED_NAME and auto.file is not None and auto.cache == tmp_path
    assert auto.location == str(route.bundled_gguf_path())
    placed = chosen(tmp_path, spec="bundled", device="cpu", max_memory="cpu=50MiB")
    assert placed.kind == GGUF_FAST and placed.request.placed
    exact = chosen(tmp_path, spec="bundled", device="cpu", precision="exact")
    assert exact.kind == GGUF_EXACT and exact.dtype == torch.float32


@pytest.mark.bundled
def test_a_gguf_path_is_named_after_its_file(tmp_path):
    taken = chosen(tmp_path, spec=str(route.bundled_gguf_path()), device="cpu")
    assert (taken.kind, taken.source) == (GGUF_FAST, "gguf")
    assert taken.name == route.bundled_gguf_path().name


@pytest.mark.bundled
def test_an_architecture_the_own_model_cannot_read_takes_transformers_reader(monkeypatch, tmp_path):
    monkeypatch.setattr(route, "unsupported_by_own_model", lambda file: "architecture 'x'")
    taken = chosen(tmp_path, spec="bundled", device="cpu")
    assert taken.kind == GGUF_OTHER and taken.unsupported == "architecture 'x'"
    with pytest.raises(ModelLoadError, match=r"Fast precision cannot run .*architecture 'x'"):
        chosen(tmp_path, spec="bundled", device="cpu", precision="fast")


@pytest.mark.bundled
def test_auto_runs_a_gguf_fast_on_cuda_and_exact_is_one_switch_away(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(route, "pick_device", lambda _: torch.device("cuda"))
    with caplog.at_level("INFO", logger="engine.load.route"):
        taken = chosen(tmp_path, spec="bundled", device="cuda", dtype="bfloat16")
    assert (taken.kind, taken.device) == (GGUF_FAST, torch.device("cuda"))
    assert "on CUDA, auto picks fast" in caplog.text
    exact = chosen(tmp_path, spec="bundled", device="cuda", dtype="bfloat16", precision="exact")
    assert exact.kind == GGUF_EXACT


@pytest.mark.bundled
def test_a_placed_load_on_a_gpu_takes_the_exact_route(monkeypatch, tmp_path):
    monkeypatch.setattr(route, "pick_device", lambda _: torch.device("cuda"))
    request = {"spec": "bundled", "device": "cuda", "dtype": "float32", "device_map": "auto"}
    assert chosen(tmp_path, **request).kind == GGUF_EXACT
    with pytest.raises(ModelLoadError, match="between RAM and disk only"):
        chosen(tmp_path, **request, precision="fast")


def test_a_folder_is_pretrained_and_never_fast(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    taken = chosen(tmp_path, spec=str(folder), device="cpu")
    assert (taken.kind, taken.source, taken.file) == (PRETRAINED, "folder", None)
    assert taken.name == taken.location == str(folder.resolve())
    with pytest.raises(ModelLoadError, match="Fast precision runs GGUF files only"):
        chosen(tmp_path, spec=str(folder), device="cpu", precision="fast")


def test_a_hub_id_is_pretrained(tmp_path):
    taken = chosen(tmp_path, spec="someone/some-model", device="cpu")
    assert (taken.kind, taken.source, taken.location) == (PRETRAINED, "hub", "someone/some-model")


def test_an_unreadable_gguf_is_refused_before_a_route(tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf")
    with pytest.raises(ModelLoadError, match="is not a readable GGUF model"):
        chosen(tmp_path, spec=str(broken), device="cpu")


def test_an_unknown_dtype_is_refused_before_anything_is_found(tmp_path):
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        choose(LoadRequest(device="cpu", dtype="int3"), tmp_path, lambda *_: pytest.fail())
