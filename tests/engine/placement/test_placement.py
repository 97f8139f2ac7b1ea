"""Layer placement: parsing, planning and refusals, probes of an offloaded model against the
same model in memory, and the weights its hooks move per step against what is on disk."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from engine.device_map import (
    DeviceMap,
    PlacementError,
    format_bytes,
    parse_device_map,
    parse_max_memory,
    parse_size,
)
from engine.events import PrefillDone, Token
from engine.generate.session import ChatSession
from engine.load import gguf_exact, loader
from engine.load.loader import ModelLoadError, place
from engine.placement import plan
from engine.placement.transfer import probe
from engine.settings import (
    GenerationSettings,
    LoadRequest,
    Message,
    ProbeSettings,
    SettingsError,
)
from tests.models import make_tiny

QUESTION = [Message("user", "Why is the sky blue? Answer briefly.")]
SETTINGS = GenerationSettings(greedy=True, max_new_tokens=8, ignore_eos=True)
CPU = torch.device("cpu")


# -- what the user writes -------------------------------------------------------------------


def test_device_map_and_max_memory_are_parsed():
    assert parse_device_map("") == DeviceMap()
    assert parse_device_map("Auto") == DeviceMap("auto")
    assert parse_device_map("gpu-layers=12") == DeviceMap("gpu-layers", 12)
    assert parse_max_memory("cpu=250MiB, cuda=2GB") == {"cpu": 250 << 20, "cuda:0": 2 * 10**9}
    assert parse_max_memory("1=1.5GiB") == {"cuda:1": int(1.5 * 2**30)}
    assert parse_size("4096") == 4096
    assert format_bytes(610_000_000) == "610 MB"


@pytest.mark.parametrize(
    ("device_map", "max_memory"),
    [("gpu-layers=x", ""), ("everywhere", ""), ("", "cpu"), ("", "ram=1GB"), ("", "cpu=lots")],
)
def test_bad_placement_is_one_clear_line(device_map, max_memory):
    with pytest.raises(SettingsError) as caught:
        LoadRequest(device_map=device_map, max_memory=max_memory)
    assert "\n" not in str(caught.value)


def test_a_request_without_placement_asks_for_none():
    assert not LoadRequest().placed
    assert LoadRequest(max_memory="cpu=1GiB").placed


# -- planning -------------------------------------------------------------------------------


def test_units_follow_the_pass_and_count_a_tied_weight_once(tokenizer):
    loaded = make_tiny(tokenizer, "llama", tie_word_embeddings=True)
    model = loaded.model
    model.tie_weights()
    found = plan.units(model)
    names = [unit.name for unit in found]
    assert names[:2] == ["model.embed_tokens", "model.layers.0"]
    assert names[-1] == "lm_head"
    assert [u.layer for u in found if u.layer is not None] == [0, 1, 2]
    every = {id(t): t for t in (*model.parameters(), *model.buffers())}.values()
    assert sum(u.bytes for u in found) == sum(t.numel() * t.element_size() for t in every)
    assert found[-1].bytes == 0  # the head's weight is the embedding's


def test_a_cap_smaller_than_one_unit_is_refused(tokenizer):
    model = make_tiny(tokenizer, "llama").model
    with pytest.raises(PlacementError, match=r"cannot work: .* must fit there whole"):
        plan.device_map(model, DeviceMap("auto"), "cpu=1MiB", CPU)


def test_gpu_layers_need_a_gpu_and_that_many_layers(tokenizer):
    model = make_tiny(tokenizer, "llama").model
    with pytest.raises(PlacementError, match="needs a CUDA device"):
        plan.device_map(model, DeviceMap("gpu-layers", 2), "", CPU)
    with pytest.raises(PlacementError, match="has 3 layers"):
        plan.device_map(model, DeviceMap("gpu-layers", 9), "", torch.device("cuda:0"))


def test_gpu_layers_fill_ram_then_disk(tokenizer):
    model = make_tiny(tokenizer, "llama").model
    layer = plan.units(model)[1].bytes
    mapping = plan.device_map(model, DeviceMap("gpu-layers", 0), f"cpu={layer}", CPU)
    assert [mapping[f"model.layers.{i}"] for i in range(3)] == ["cpu", "disk", "disk"]
    assert mapping["model.embed_tokens"] == mapping["lm_head"] == "cpu"


def test_out_of_memory_becomes_a_proposal(monkeypatch):
    monkeypatch.setattr(plan, "free_memory", lambda device: 1 << 30)
    assert plan.fit_proposal("big", 1 << 29, CPU) is None
    proposal = plan.fit_proposal("big", 3 << 30, CPU)
    assert proposal is not None and "\n" not in proposal.line
    assert (
        "2.1 GB missing" in proposal.line and "--device-map auto --max-memory cpu=" in proposal.line
    )
    # The same placement as fields, for the window to offer: a cap below what is free now.
    assert proposal.device_map == "auto" and proposal.max_memory.startswith("cpu=")
    assert parse_max_memory(proposal.max_memory)["cpu"] < 1 << 30
    assert f"--max-memory {proposal.max_memory} " in proposal.line
    gpu = plan.fit_proposal("big", 3 << 30, torch.device("cuda:0"), layers=30)
    assert gpu is not None and "--device-map gpu-layers=8 " in gpu.line
    assert (gpu.device_map, gpu.max_memory) == ("gpu-layers=8", "")


def skeleton() -> torch.nn.Module:
    """A Llama of 8 layers that outweigh its embedding, on the meta device: planning only."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    with init_empty_weights():
        return AutoModelForCausalLM.from_config(config)


def layer_places(mapping: dict[str, str]) -> list[str]:
    return [mapping[f"model.layers.{i}"] for i in range(8)]


def test_a_cuda_load_plans_over_every_gpu(monkeypatch):
    """Two GPUs, none of them here: the plan is accelerate's over both (the placing waits)."""
    model = skeleton()
    total = sum(unit.bytes for unit in plan.units(model))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(plan, "free_memory", lambda d: total * 10 if "cuda" in d else 8 << 30)
    cuda = torch.device("cuda:0")
    balanced = plan.device_map(model, DeviceMap("balanced"), "", cuda)
    assert layer_places(balanced) == ["cuda:0"] * 4 + ["cuda:1"] * 4
    assert set(balanced.values()) == {"cuda:0", "cuda:1"}  # nothing in RAM, nothing moves
    capped = layer_places(plan.device_map(model, DeviceMap("auto"), f"cuda:0={total // 2}", cuda))
    assert capped == sorted(capped) and {"cuda:0", "cuda:1"} == set(capped)  # 0 fills first
    assert layer_places(plan.device_map(model, DeviceMap("sequential"), "", cuda)) == ["cuda:0"] * 8
    on_first = plan.device_map(model, DeviceMap("gpu-layers", 3), "", cuda)
    assert layer_places(on_first) == ["cuda:0"] * 3 + ["cpu"] * 5


# -- an offloaded model runs as it would in memory -----------------------------------------


def offloaded_tiny(tokenizer, tmp_path, max_memory: str, device_map: str = "auto"):
    loaded = make_tiny(tokenizer, "llama")
    request = LoadRequest(device_map=device_map, max_memory=max_memory)
    return place(loaded, request, CPU, tmp_path)


def small_cap(tokenizer) -> str:
    """A RAM cap under the tiny model's size: accelerate keeps room for its largest unit (the
    head, as large as the embedding) to be read in, so the head goes to disk."""
    found = plan.units(make_tiny(tokenizer, "llama").model)
    return f"cpu={2 * found[0].bytes + 3 * found[1].bytes}"


def one_layer(tokenizer) -> str:
    """gpu-layers=0 with RAM for one layer: on the CPU, layers 1 and 2 go to disk."""
    return f"cpu={plan.units(make_tiny(tokenizer, 'llama').model)[1].bytes}"


def run(loaded):
    probes = ProbeSettings(attention_layers=(0, 1, 2), top_k=5)
    events = list(ChatSession(loaded).generate(QUESTION, SETTINGS, probes))
    return events[0], [e for e in events if isinstance(e, Token)]


@pytest.mark.parametrize("layers_on_disk", [False, True])
def test_probes_of_an_offloaded_model_equal_it_in_memory(tokenizer, tmp_path, layers_on_disk):
    if layers_on_disk:
        placed = offloaded_tiny(tokenizer, tmp_path, one_layer(tokenizer), "gpu-layers=0")
        assert placed.info.placement.layer_places == ("cpu", "disk", "disk")
    else:
        placed = offloaded_tiny(tokenizer, tmp_path, small_cap(tokenizer))
    assert placed.info.placement.moved_bytes > 0  # the test means nothing otherwise
    assert placed.info.device == "cpu"
    assert_same_probes(run(make_tiny(tokenizer, "llama")), run(placed))


def assert_same_probes(reference, offloaded) -> None:
    (prefill, tokens), (prefill_off, tokens_off) = reference, offloaded
    assert isinstance(prefill_off, PrefillDone)
    assert [t.token_id for t in tokens_off] == [t.token_id for t in tokens]
    assert prefill_off.kv_bytes_per_layer == prefill.kv_bytes_per_layer
    for layer, matrix in prefill.attention.items():
        np.testing.assert_allclose(prefill_off.attention[layer], matrix, atol=1e-5)
    for token, token_off in zip(tokens, tokens_off, strict=True):
        assert token_off.kv_bytes_per_layer == token.kv_bytes_per_layer
        for layer, row in token.attention.items():
            np.testing.assert_allclose(token_off.attention[layer], row, atol=1e-5)
        assert [c.token_id for c in token_off.top_k] == [c.token_id for c in token.top_k]
        np.testing.assert_allclose(
            [c.prob for c in token_off.top_k], [c.prob for c in token.top_k], atol=1e-5
        )


def test_each_step_reads_what_is_on_disk(tokenizer, tmp_path):
    placed = offloaded_tiny(tokenizer, tmp_path, one_layer(tokenizer), "gpu-layers=0")
    on_disk = sum(
        entry.stat().st_size
        for folder in (tmp_path / "offload").iterdir()
        for entry in os.scandir(folder)
        if entry.name.endswith(".dat")
    )
    placement = placed.info.placement
    assert placement.moved_bytes == pytest.approx(on_disk, rel=0.01)
    assert placement.read_bytes_per_s > 0 and placement.compute_s > 0
    assert placement.predicted_step_s == placement.compute_s + placement.predicted_transfer_s
    _, tokens = run(placed)
    for token in tokens[1:]:  # token 0 came from the prefill
        assert token.transfer is not None
        assert token.transfer.bytes == pytest.approx(on_disk, rel=0.2)
        assert 0 < token.transfer.seconds <= token.seconds
        assert token.transfer.predicted_s == placement.predicted_transfer_s
        assert token.transfer.predicted_step_s == placement.predicted_step_s
    assert tokens[0].transfer is None


def test_the_probe_passes_read_what_a_step_reads_within_their_budget(tokenizer, tmp_path):
    placed = offloaded_tiny(tokenizer, tmp_path, one_layer(tokenizer), "gpu-layers=0")
    meter, moved = placed.transfers, placed.info.placement.moved_bytes
    assert meter is not None
    passes = []
    placed.model.register_forward_pre_hook(lambda module, args: passes.append(1))
    one = probe(placed.model, meter, torch.device("cpu"), budget_s=0.0)
    assert len(passes) == 1  # over budget after the first pass: no second one
    assert one.bytes == moved and 0 < one.transfer_s <= one.seconds
    assert one.read_bytes_per_s == one.bytes / one.transfer_s
    assert one.compute_s == one.seconds - one.transfer_s
    fastest = probe(placed.model, meter, torch.device("cpu"), budget_s=60.0, most=3)
    assert len(passes) == 4 and fastest.bytes == moved
    assert meter.take() == (0, 0.0)  # decode's meter starts clean


def test_a_placement_that_fits_adds_no_hooks_and_no_meter(tokenizer, tmp_path):
    placed = offloaded_tiny(tokenizer, tmp_path, "cpu=1GiB")
    assert set(placed.info.placement.layer_places) == {"cpu"}
    assert placed.info.placement.moved_bytes == 0
    assert placed.transfers is None
    assert not any(hasattr(m, "_hf_hook") for m in placed.model.modules())
    _, tokens = run(placed)
    assert all(t.transfer is None for t in tokens)


def test_the_default_load_has_no_placement(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    assert loaded.info.placement is None and loaded.transfers is None
    _, tokens = run(loaded)
    assert all(t.transfer is None for t in tokens)


def test_the_offload_folder_goes_with_the_model(tokenizer, tmp_path):
    placed = offloaded_tiny(tokenizer, tmp_path, small_cap(tokenizer))
    (folder,) = (tmp_path / "offload").iterdir()
    assert any(folder.iterdir())
    del placed
    import gc

    gc.collect()
    assert not folder.exists()


# -- the bundled model ----------------------------------------------------------------------


@pytest.mark.bundled
def test_bundled_refuses_a_cap_below_one_layer_before_dequantising(monkeypatch, tmp_path):
    def never(*args, **kwargs):
        raise AssertionError("dequantised before the plan was checked")

    monkeypatch.setattr(gguf_exact, "build_exact", never)
    request = LoadRequest(spec="bundled", device="cpu", max_memory="cpu=1MiB")
    with pytest.raises(ModelLoadError, match=r"Placement refused: a cap of 1\.0 MB on cpu"):
        loader.load_model(request, cache_dir=tmp_path)


@pytest.mark.bundled
def test_bundled_too_big_for_free_memory_gets_a_proposal(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_exact, "build_exact", lambda *a, **k: pytest.fail("loaded anyway"))
    monkeypatch.setattr(plan, "free_memory", lambda device: 400 << 20)
    request = LoadRequest(spec="bundled", device="cpu", precision="exact")
    with pytest.raises(
        ModelLoadError, match=r"missing\. It would fit as --device-map auto"
    ) as error:
        loader.load_model(request, cache_dir=tmp_path)
    # Half of what is free on a small machine, above the largest unit (the 113 MB embedding).
    assert error.value.fits_as == plan.Proposal(str(error.value), "auto", "cpu=200MiB")

    # With less free than the largest unit needs, no placement is proposed: it would not run.
    monkeypatch.setattr(plan, "free_memory", lambda device: 100 << 20)
    with pytest.raises(ModelLoadError, match=r"not run either: .*embed_tokens \(113 MB\)") as error:
        loader.load_model(request, cache_dir=tmp_path)
    assert error.value.fits_as is not None and error.value.fits_as.device_map == ""


@pytest.mark.bundled
def test_a_proposal_says_what_its_load_puts_on_disk(monkeypatch, tmp_path):
    # accelerate keeps room in RAM for the largest unit it brings in, so more than what
    # exceeds the cap goes to disk: the line says what the load it proposes really does.
    free_now = plan.free_memory
    monkeypatch.setattr(plan, "free_memory", lambda device: 400 << 20)
    request = LoadRequest(spec="bundled", device="cpu", precision="exact")
    with pytest.raises(ModelLoadError) as error:
        loader.load_model(request, cache_dir=tmp_path)
    fits = error.value.fits_as
    assert fits is not None and fits.max_memory == "cpu=200MiB"

    monkeypatch.setattr(plan, "free_memory", free_now)
    placed = dataclasses.replace(request, device_map=fits.device_map, max_memory=fits.max_memory)
    loaded = loader.load_model(placed, cache_dir=tmp_path)
    assert loaded.info.placement is not None
    disk = dict(loaded.info.placement.place_bytes)["disk"]
    assert disk > 538_000_000 - (200 << 20)  # more than the naive excess over the cap
    assert f"({format_bytes(disk)} of weights read from disk on every token)" in fits.line


@pytest.mark.bundled
def test_bundled_capped_below_its_size_probes_as_in_memory(bundled, tmp_path):
    request = LoadRequest(spec="bundled", device="cpu", precision="exact", max_memory="cpu=250MiB")
    placed = loader.load_model(request, cache_dir=tmp_path)
    placement = placed.info.placement
    assert placement is not None and "disk" in placement.layer_places
    assert dict(placement.place_bytes)["cpu"] <= 250 << 20
    reference, offloaded = run_bundled(bundled), run_bundled(placed)
    assert_same_probes(reference, offloaded)
    for token in offloaded[1][1:]:
        assert token.transfer.bytes == pytest.approx(placement.moved_bytes, rel=0.2)


def run_bundled(loaded):
    probes = ProbeSettings(attention_layers=(0, 15, 29), top_k=5)
    events = list(ChatSession(loaded).generate(QUESTION, SETTINGS, probes))
    return events[0], [e for e in events if isinstance(e, Token)]


def test_a_gguf_streams_its_disk_placed_weights_without_holding_them(tmp_path):
    """The exact path writes each disk-placed weight as it is dequantised: those weights never
    sit in the model in RAM, and the placed model computes what the one in memory does."""
    from engine.gguf.reader import GGUFFile
    from engine.model import reference
    from engine.placement.dispatch import DiskWriter, offload_folder, place_in_memory
    from tests.engine.model.test_fast import hf_model
    from tests.gguf_files import F32, write_gguf

    file = GGUFFile(write_gguf(tmp_path / "f32.gguf", hf_model("llama"), F32, F32))
    in_memory = reference.build_exact(file, torch.float32)
    mapping = {unit.name: "cpu" for unit in plan.units(in_memory)}
    mapping["model.layers.1"] = mapping["model.layers.2"] = "disk"
    writer = DiskWriter(mapping, offload_folder(tmp_path))
    streamed = reference.build_exact(file, torch.float32, sink=writer)
    writer.close()
    on_meta = {name for name, p in streamed.named_parameters() if p.is_meta}
    assert on_meta == {n for n, _ in in_memory.named_parameters() if n.startswith(DISKED)}
    placed = place_in_memory(streamed, mapping, CPU, tmp_path, "test", writer)
    assert placed.placement.layer_places == ("cpu", "disk", "disk")
    ids = torch.randint(0, 49152, (1, 12))
    with torch.inference_mode():
        torch.testing.assert_close(streamed(ids).logits, in_memory(ids).logits, rtol=0, atol=1e-5)


DISKED = ("model.layers.1.", "model.layers.2.")


def test_placement_and_transfer_cross_the_wire_and_into_json(tokenizer, tmp_path):
    import pickle

    from engine.serialize import event_to_dict, plain

    placed = offloaded_tiny(tokenizer, tmp_path, one_layer(tokenizer), "gpu-layers=0")
    _, tokens = run(placed)
    info = pickle.loads(pickle.dumps(placed.info))  # the engine process pickles what it sends
    assert info.placement == placed.info.placement
    assert pickle.loads(pickle.dumps(tokens[1])).transfer == tokens[1].transfer
    assert plain(info)["placement"]["layer_places"] == ["cpu", "disk", "disk"]
    assert event_to_dict(tokens[1])["transfer"]["bytes"] == tokens[1].transfer.bytes
