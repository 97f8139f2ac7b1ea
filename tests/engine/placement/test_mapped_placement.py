"""Placement of Glassbox's own GGUF model: disk-placed layers compute from the mapped file,
the RAM-placed ones are held in memory, the probes equal the unplaced model's, and a step
whose pages the OS dropped reads them back, counted and timed against the prediction."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.device_map import DeviceMap
from engine.events import Token
from engine.generate.session import ChatSession
from engine.gguf.reader import GGUFFile
from engine.load import gguf_fast, loader, route
from engine.load.loader import LoadedModel, ModelLoadError, describe_fast
from engine.model.fast_builder import build_fast, fast_skeleton
from engine.placement import mapped, plan
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings
from tests.engine.model.test_fast import hf_model
from tests.engine.placement.test_placement import assert_same_probes
from tests.gguf_files import Q4_1, Q8_0, write_gguf

QUESTION = [Message("user", "Why is the sky blue? Answer briefly.")]
SETTINGS = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True)
CPU = torch.device("cpu")


@pytest.fixture(params=["llama", "qwen2"])
def tiny_gguf(request, tmp_path, monkeypatch):
    """A tiny GGUF whose weights all go to the GGML kernels (views of the file when placed
    on disk), whatever this CPU's kernel set."""
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "all")
    return write_gguf(tmp_path / f"{request.param}.gguf", hf_model(request.param), Q4_1, Q8_0)


def load(path, tokenizer, max_memory: str = "") -> LoadedModel:
    """The fast model of `path` placed as the loader places it under `max_memory` (a tiny
    GGUF has no tokenizer of its own: the bundled one stands in)."""
    file = GGUFFile(path)
    places = None
    if max_memory:
        places = plan.device_map(fast_skeleton(file), DeviceMap("auto"), max_memory, CPU)
    disk = frozenset(int(n.split(".")[2]) for n, p in (places or {}).items() if p == "disk"
                     and n.startswith("model.layers."))  # fmt: skip
    model = build_fast(file, mapped_layers=disk)
    info = describe_fast(model, path.name, "gguf")
    if places is None:
        return LoadedModel(model, tokenizer, info)
    placed = gguf_fast.place_fast(model, places, "test")
    info = dataclasses.replace(info, placement=placed.placement)
    return LoadedModel(model, tokenizer, info, transfers=placed.meter)


def run(loaded: LoadedModel, layers: tuple[int, ...]):
    probes = ProbeSettings(attention_layers=layers, top_k=5)
    events = list(ChatSession(loaded).generate(QUESTION, SETTINGS, probes))
    return events[0], [e for e in events if isinstance(e, Token)]


def one_layer_cap(path) -> str:
    """A RAM cap that holds the first layer and not the second (nor the head)."""
    from engine.gguf.reader import GGUFFile
    from engine.model.fast_builder import fast_skeleton
    from engine.placement.plan import units

    found = units(fast_skeleton(GGUFFile(path)))
    head = max(unit.bytes for unit in found)  # room kept for the largest unit, as accelerate
    return f"cpu={found[0].bytes + head + 1}"


def test_disk_placed_layers_are_views_of_the_file_and_compute_the_same(tiny_gguf, tokenizer):
    reference = load(tiny_gguf, tokenizer)
    placed = load(tiny_gguf, tokenizer, max_memory=one_layer_cap(tiny_gguf))
    placement = placed.info.placement
    assert placed.info.precision == "fast" and placement is not None and placement.mapped
    layers = len(placed.model.blocks)
    assert placement.layer_places == ("cpu",) + ("disk",) * (layers - 1)
    first, second = placed.model.blocks[:2]
    assert not any(mapped.file_backed(mapped.span(t) for t in mapped.weights(first)))
    spans, held = mapped.mapped_spans(second)
    assert spans and sum(n for _, n in spans) >= placement.layer_bytes[1] - held
    assert placed.transfers is not None and placed.model.compile_refusal  # read in, eagerly
    watched = tuple(range(layers))
    assert_same_probes(run(reference, watched), run(placed, watched))


def test_disk_placed_products_stay_fused_where_the_file_allows(tiny_gguf, tokenizer):
    """q/k/v stay one product where the file holds them side by side; llama's q and k, whose
    rows are reordered, are one copy, and its v a view of its own."""
    from engine.weights import linear

    placed = load(tiny_gguf, tokenizer, max_memory=one_layer_cap(tiny_gguf))
    file = GGUFFile(tiny_gguf)
    qkv = placed.model.blocks[1].attention.qkv
    products = qkv.linears() if isinstance(qkv, linear.PartsLinear) else [qkv]
    q, k, v = (f"blk.1.attn_{x}.weight" for x in "qkv")
    if tiny_gguf.stem == "llama":
        expected = 2
    else:
        expected = 1 + (not file.adjacent(q, k)) + (not file.adjacent(k, v))
    assert len(products) == expected
    assert mapped.file_backed([mapped.span(products[-1].raw)]) == [True]  # v: in the file


def test_a_cap_that_holds_everything_adds_no_meter(tiny_gguf, tokenizer):
    placed = load(tiny_gguf, tokenizer, max_memory="cpu=1GiB")
    assert set(placed.info.placement.layer_places) == {"cpu"}
    assert placed.transfers is None and placed.model.read_in is None
    assert not placed.info.placement.moved_bytes


def test_a_cap_below_one_layer_is_refused_before_loading(tiny_gguf, tmp_path):
    request = LoadRequest(spec=str(tiny_gguf), device="cpu", max_memory="cpu=10")
    with pytest.raises(loader.ModelLoadError, match="Placement refused: a cap of 10 B on cpu"):
        loader.load_model(request, cache_dir=tmp_path / "cache")  # before its tokenizer


def test_the_fast_model_places_nothing_on_a_gpu(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(route, "pick_device", lambda _: torch.device("cuda"))
    request = LoadRequest(spec=str(tiny_gguf), precision="fast", max_memory="cpu=1GiB")
    with pytest.raises(loader.ModelLoadError, match="between RAM and disk only"):
        loader.load_model(request, cache_dir=tmp_path / "cache")


@pytest.mark.bundled
def test_bundled_capped_runs_fast_with_the_probes_of_it_in_memory(bundled_fast, tmp_path):
    request = LoadRequest(spec="bundled", device="cpu", max_memory="cpu=40MiB", compiled=False)
    placed = loader.load_model(request, cache_dir=tmp_path)
    placement = placed.info.placement
    assert placed.info.precision == "fast"  # auto: a capped load on the CPU stays fast
    assert placement.mapped and placement.layer_places.count("disk") >= 20
    assert dict(placement.place_bytes)["cpu"] <= 40 << 20
    # every disk-placed layer computes from the mapped file (llama's q/k rows, reordered, are
    # copied: ~11% of a layer), also after the read-ahead advice split the file's mappings
    for block, place in zip(placed.model.blocks, placement.layer_places, strict=True):
        spans, held = mapped.mapped_spans(block)
        if place == "disk":
            assert held < 0.15 * (held + sum(length for _, length in spans))
        else:  # held in memory of its own, the repacks the pack cache mapped copied in
            assert not spans
    layers = (0, 15, 29)
    assert_same_probes(run(bundled_fast, layers), run(placed, layers))


@pytest.mark.bundled
def test_a_step_reads_back_what_the_os_dropped_and_drops_behind(tmp_path, monkeypatch):
    """Every disk-placed page dropped before a step (as memory pressure would): the step
    finds them missing, reads them back (the kernel's count within 20% of their bytes), is
    predicted from them, and drops each unit behind it; a later pass keeps its pages, and the
    one after it finds nothing missing and stops dropping."""
    monkeypatch.setattr(mapped, "PROBE_PASSES", 2)
    request = LoadRequest(spec="bundled", device="cpu", max_memory="cpu=40MiB", compiled=False)
    placed = loader.load_model(request, cache_dir=tmp_path)
    placement, meter = placed.info.placement, placed.transfers
    if placement.read_bytes_per_s <= 0:
        pytest.skip("the file system here gives no storage reads to count (tmpfs?)")
    spans = [span for unit in meter.spans.values() for span in unit]
    ids = torch.zeros((1, 1), dtype=torch.long)
    cache = placed.model.new_cache()

    def missing() -> int:
        return sum(mapped.missing_bytes(address, length) for address, length in spans)

    def metered_pass() -> tuple[int, float, bool]:
        meter.begin()
        with torch.inference_mode():
            placed.model(ids, cache, None)
        return *meter.take(), meter.dropping

    with torch.inference_mode():
        placed.model(ids, cache, None)
    meter.drop_all()
    # counted here: pages another mapping of the same file holds (another model of it in
    # this process) are not dropped
    dropped = missing()
    moved, seconds, dropping = metered_pass()
    assert dropped > placement.moved_bytes / 2  # the test means nothing otherwise
    assert meter.missing == dropped
    assert moved == pytest.approx(dropped, rel=0.2)
    assert seconds > 0 and meter.predicted_s() == pytest.approx(
        meter.missing / placement.read_bytes_per_s
    )
    assert dropping and missing() >= dropped  # each unit left the page cache once it ran
    later = [metered_pass() for _ in range(3)]
    assert not all(dropping for _, _, dropping in later[:2])  # a pass kept its pages
    assert later[-1][0] == 0 and not later[-1][2]  # then nothing was missing


@pytest.mark.bundled
def test_a_fast_load_too_big_for_free_memory_proposes_a_ram_cap(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_fast, "build_fast", lambda *a, **k: pytest.fail("loaded anyway"))
    monkeypatch.setattr(plan, "free_memory", lambda device: 60 << 20)  # the units: 97 MB
    request = LoadRequest(spec="bundled", device="cpu", precision="fast")
    with pytest.raises(ModelLoadError, match=r"It would fit as --device-map auto") as error:
        loader.load_model(request, cache_dir=tmp_path)
    # half of what is free: above the largest unit (the 30 MB head), so the plan can run
    assert error.value.fits_as == plan.Proposal(str(error.value), "auto", "cpu=30MiB")
    assert "of layers left in the mapped file, read from disk where the OS" in str(error.value)


@pytest.mark.bundled
def test_the_placement_bench_reports_steps_against_their_prediction(tmp_path):
    from app.bench import placement as placement_benchmark

    request = LoadRequest(spec="bundled", device="cpu", max_memory="cpu=40MiB", compiled=False)
    placed = loader.load_model(request, cache_dir=tmp_path)
    report = placement_benchmark.run(placed, None, new_tokens=4, repeats=1, evict=True)
    assert report["steps"] == 3 and report["evict"]  # token 0 comes from the prefill
    assert report["place_bytes"] == dict(placed.info.placement.place_bytes)
    assert report["decode_tokens_per_s"]["placed"] > 0 and report["step_vs_predicted"] > 0
    if placed.info.placement.read_bytes_per_s > 0:  # storage reads to count here
        assert report["bytes_read_vs_moved"] == pytest.approx(1, rel=0.2)
    with pytest.raises(ValueError, match="needs a placed load"):
        placement_benchmark.run(loader.load_model(LoadRequest(spec="bundled", device="cpu",
                                                              compiled=False)), None)  # fmt: skip


@pytest.mark.bundled
def test_a_fast_load_that_runs_out_of_memory_proposes_its_own_cap(monkeypatch, tmp_path):
    """Out of memory while building (after the fit check passed), the proposal is the fast
    model's own: its units' bytes, its disk the mapped file (not the dequantised model's)."""

    def no_memory(*args, **kwargs):
        raise MemoryError

    free = iter([1 << 40, 60 << 20])  # room at the check, then none
    monkeypatch.setattr(plan, "free_memory", lambda device: next(free))
    monkeypatch.setattr(gguf_fast, "build_fast", no_memory)
    request = LoadRequest(spec="bundled", device="cpu", precision="fast")
    with pytest.raises(ModelLoadError, match=r"needs 96\.6 MB on cpu") as error:
        loader.load_model(request, cache_dir=tmp_path)
    assert error.value.fits_as == plan.Proposal(str(error.value), "auto", "cpu=30MiB")
    assert "left in the mapped file" in str(error.value)
