"""The roofline of each pass: FLOPs and bytes against hand counts, events that carry them, and
the bundled model's prefill right of the ridge point and its decode left of it."""

from __future__ import annotations

import json

import pytest
import torch

from engine.events import Peaks, PrefillDone, Token
from engine.generate.session import ChatSession
from engine.gguf.reader import GGUFFile
from engine.load.loader import LoadedModel, describe_fast
from engine.measure import peaks as peaks_module
from engine.measure.roofline import ForwardCost, _pairs
from engine.serialize import event_to_dict
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.weights import ggml_kernel
from tests.gguf_files import Q4_1, write_gguf
from tests.models import make_tiny

# Ceilings for tests that only need a ridge point: 100 GFLOP/s over 10 GB/s = 10 FLOP/byte.
FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")
ROOFLINE_KEYS = {"flops", "bytes", "intensity", "flops_per_s", "bytes_per_s", "bound"}

# tests.models' tiny Llama: 3 layers, hidden 64, MLP 128, 4 heads of 16, 2 KV heads, untied head.
LAYERS, DIM, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 3, 64, 128, 4, 2, 16, 49152
# Per layer: q and o are DIM x DIM, k and v DIM x 32, gate, up and down DIM x FFN.
LAYER_PARAMS = 2 * DIM * DIM + 2 * DIM * KV_HEADS * HEAD_DIM + 3 * DIM * FFN  # 36,864
HEAD_PARAMS = DIM * VOCAB
ATTENTION_PER_PAIR = LAYERS * 4 * HEADS * HEAD_DIM  # q·kᵀ and weights·v, every layer


def test_pairs_are_the_causal_count():
    """Closed form against counting the keys each query row sees, with and without a window."""
    for window in (None, 1, 3, 8, 50):
        for cached in (0, 1, 5, 9, 20):
            for new in (1, 2, 7, 30):
                seen = sum(
                    t if window is None else min(t, window)
                    for t in range(cached + 1, cached + new + 1)
                )
                assert _pairs(new, cached, window) == seen, (new, cached, window)


def test_exact_llama_counts_by_hand(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    cost = ForwardCost.of(loaded.model, loaded.info)
    # fp32 weights read once per pass: blocks (with their two norms), final norm, head.
    weights = 4 * (LAYERS * (LAYER_PARAMS + 2 * DIM) + DIM + HEAD_PARAMS)
    kv_position = 2 * KV_HEADS * HEAD_DIM * 4  # one position's keys + values, one layer

    # A 10-token prompt: 55 causal pairs; reads 10 positions, writes 10 (cat of an empty cache).
    assert cost.flops(10, 0) == 2 * LAYER_PARAMS * LAYERS * 10 + 2 * HEAD_PARAMS + (
        ATTENTION_PER_PAIR * 55
    )
    assert cost.bytes(10, 0) == weights + 10 * DIM * 4 + LAYERS * (10 + 10) * kv_position
    # One decode step after 10 cached: 11 keys; DynamicCache's cat reads the 10 old positions
    # and writes all 11 again, and attention reads the 11.
    assert (
        cost.flops(1, 10) == 2 * LAYER_PARAMS * LAYERS + 2 * HEAD_PARAMS + ATTENTION_PER_PAIR * 11
    )
    assert cost.bytes(1, 10) == weights + DIM * 4 + LAYERS * (11 + 10 + 11) * kv_position
    # Without a cache nothing is written and the whole sequence runs again.
    assert cost.bytes(11, 0, with_cache=False) == weights + 11 * DIM * 4 + LAYERS * 11 * kv_position


def test_gpt2_counts_conv1d_projections_and_a_tied_head(tokenizer):
    loaded = make_tiny(tokenizer, "gpt2")
    model = loaded.model
    cost = ForwardCost.of(model, loaded.info)
    # Per layer: c_attn 64x192, attn c_proj 64x64, c_fc 64x256, mlp c_proj 256x64.
    assert cost.matmul_params == 2 * (64 * 192 + 64 * 64 + 64 * 256 + 256 * 64)
    assert cost.head_params == VOCAB * 64
    wte, wpe = model.transformer.wte.weight, model.transformer.wpe.weight
    everything = sum(p.numel() for p in model.parameters())
    # The tied head reads the token embedding whole; both embeddings are looked up per token.
    assert cost.weight_bytes == 4 * (everything - wpe.numel())
    assert cost.row_bytes == 4 * (wte.shape[1] + wpe.shape[1])


def test_sliding_layers_attend_within_their_window(tokenizer):
    loaded = make_tiny(tokenizer, "gemma3")  # layer 0 slides over 8 tokens, layer 1 is global
    cost = ForwardCost.of(loaded.model, loaded.info)
    assert cost.windows == ((8, 1), (None, 1))
    attention = cost.flops(1, 20) - cost.flops(1, 0) + 4 * 4 * 16 * 2  # both layers' 1 key
    assert attention == 4 * 4 * 16 * (8 + 21)


@pytest.mark.usefixtures("int4_layouts")
def test_fast_gguf_counts_the_packed_bytes_by_hand(tokenizer, tmp_path):
    hf = make_tiny(tokenizer, "llama", attn="eager")
    path = write_gguf(tmp_path / "tiny.gguf", hf, Q4_1, "Q8_0")
    from engine.model import fast_builder

    model = fast_builder.build_fast(GGUFFile(path))
    cost = ForwardCost.of(model, describe_fast(model, "tiny", "gguf"))
    # Q4_1 repacked for the int4 kernel: a nibble per weight plus a bf16 scale and zero per 32
    # weights = 0.625 bytes a weight. Norms and RoPE frequencies in float32.
    packed = lambda params: params * 5 // 8  # noqa: E731
    weights = (
        packed(LAYERS * LAYER_PARAMS)
        + packed(HEAD_PARAMS)
        + 4 * (LAYERS * 2 * DIM + DIM)
        + 4 * HEAD_DIM // 2
    )
    head_row = DIM // 32 * 20  # the 64 likeliest logits are recomputed from the file's Q4_1 rows
    embedding_row = DIM // 32 * 34  # Q8_0 rows, looked up per token
    kv_position = 2 * KV_HEADS * HEAD_DIM * 2  # bf16 cache
    assert cost.bytes(1, 10) == (
        weights + 64 * head_row + embedding_row + LAYERS * (11 + 1) * kv_position
    )
    assert cost.flops(1, 10) == (
        2 * LAYER_PARAMS * LAYERS + 2 * (HEAD_PARAMS + 64 * DIM) + ATTENTION_PER_PAIR * 11
    )


# -- the events ---------------------------------------------------------------------------------


def run(session, messages, **settings):
    return list(
        session.generate(messages, GenerationSettings(greedy=True, **settings), ProbeSettings.off())
    )


def test_events_carry_each_pass_counted_and_timed(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    events = run(session, [Message("user", "Count the passes")], max_new_tokens=4, ignore_eos=True)
    prefill = events[0]
    tokens = [e for e in events if isinstance(e, Token)]
    assert isinstance(prefill, PrefillDone) and len(tokens) == 4
    cost, prompt = session.meter.cost, prefill.prompt_tokens

    r = prefill.roofline
    assert (r.flops, r.bytes) == (cost.flops(prompt, 0), cost.bytes(prompt, 0))
    assert r.intensity == pytest.approx(r.flops / r.bytes)
    assert r.flops_per_s == pytest.approx(r.flops / prefill.seconds)
    assert r.bytes_per_s == pytest.approx(r.bytes / prefill.seconds)
    assert r.bound == ("compute" if r.intensity >= FIXED.ridge else "memory")

    assert tokens[0].roofline is None  # its logits came from the prefill
    for token in tokens[1:]:  # one new position over the prompt and the tokens before it
        cached = prompt + token.index - 1
        step = token.roofline
        assert (step.flops, step.bytes) == (cost.flops(1, cached), cost.bytes(1, cached))
        assert step.flops_per_s == pytest.approx(step.flops / token.seconds)
        assert step.bound == "memory"  # 1 token: ~1 FLOP per fp32 byte, far below 10
    data = event_to_dict(tokens[1])
    assert set(data["roofline"]) == ROOFLINE_KEYS
    json.dumps(data)


def test_a_second_turn_counts_only_its_new_tokens(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    first = [Message("user", "Hello there")]
    reply = run(session, first, max_new_tokens=3, ignore_eos=True)[-1].text
    events = run(session, [*first, Message("assistant", reply), Message("user", "And now?")],
                 max_new_tokens=2)  # fmt: skip
    prefill = events[0]
    assert prefill.reused_tokens > 0
    cost = session.meter.cost
    expected = cost.flops(prefill.processed_tokens, prefill.reused_tokens)
    assert prefill.roofline.flops == expected


def test_without_the_cache_every_step_is_a_whole_prefill(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    events = run(session, [Message("user", "No cache")], max_new_tokens=3, ignore_eos=True,
                 use_cache=False)  # fmt: skip
    prompt = events[0].prompt_tokens
    cost = session.meter.cost
    for token in [e for e in events if isinstance(e, Token)][1:]:
        length = prompt + token.index
        assert token.roofline.flops == cost.flops(length, 0)
        assert token.roofline.bytes == cost.bytes(length, 0, with_cache=False)


def test_the_session_reports_its_peaks_in_the_model_info(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    assert session.info.peaks == FIXED


# -- the bundled model ------------------------------------------------------------------------

NOISE = 1.3  # two timings on a shared machine: a phase may beat a probe by this much, no more


def fresh_peaks(device: str, dtype: str) -> Peaks:
    """Peaks measured now, twice, the better of each kept: the ceiling nearest the truth."""
    runs = [peaks_module.measure(torch.device(device), peaks_module._dtype(dtype)) for _ in "ab"]
    best_flops = max(runs, key=lambda p: p.peak_flops_per_s)
    best_bytes = max(runs, key=lambda p: p.peak_bytes_per_s)
    return Peaks(best_flops.peak_flops_per_s, best_bytes.peak_bytes_per_s, dtype, device, "test")


@pytest.mark.bundled
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_bundled_prefill_is_compute_bound_and_decode_memory_bound(precision, request):
    loaded: LoadedModel = request.getfixturevalue(
        "bundled" if precision == "exact" else "bundled_fast"
    )
    peaks = fresh_peaks("cpu", loaded.info.dtype)
    session = ChatSession(loaded, peaks=peaks)
    text = "The quick brown fox jumps over the lazy dog. " * 60
    ids = loaded.tokenizer(text)["input_ids"][:512]
    prompt = loaded.tokenizer.decode(ids)
    settings = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True)
    events = list(session.generate([Message("user", prompt)], settings, ProbeSettings.off()))
    prefill = events[0]
    steps = [e.roofline for e in events if isinstance(e, Token) and e.roofline is not None]
    assert isinstance(prefill, PrefillDone) and prefill.processed_tokens >= 512
    assert len(steps) == 5

    assert prefill.roofline.intensity > peaks.ridge
    assert prefill.roofline.bound == "compute"
    for step in steps:
        assert step.intensity < peaks.ridge
        assert step.bound == "memory"
    # Never faster than the machine allows: else the count or the peak is wrong.
    for phase in (prefill.roofline, *steps):
        assert phase.flops_per_s <= peaks.peak_flops_per_s * NOISE
        assert phase.bytes_per_s <= peaks.peak_bytes_per_s * NOISE


def test_peaks_are_cached_per_machine_and_a_damaged_file_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setattr(peaks_module, "_memo", {})
    path = tmp_path / peaks_module.CACHE_FILE
    path.write_text("{not json")
    first = peaks_module.machine_peaks("cpu", "float32", quick=True, cache_dir=tmp_path)
    assert first.peak_flops_per_s > 0 and first.peak_bytes_per_s > 0
    (key,) = json.loads(path.read_text())  # rewritten whole, the quick probe kept apart
    assert key.endswith("|quick") and "float32" in key and "threads=" in key

    monkeypatch.setattr(peaks_module, "_memo", {})  # a new process: read from the file
    monkeypatch.setattr(peaks_module, "measure", lambda *a: pytest.fail("measured again"))
    assert peaks_module.machine_peaks("cpu", "float32", quick=True, cache_dir=tmp_path) == first


def test_a_first_load_measures_the_peaks_as_a_stage_before_ready(tiny_folder, monkeypatch):
    """Unknown peaks are measured inside the load, named in its progress; known ones are not."""
    from engine.load.loader import load_model
    from engine.settings import LoadRequest

    monkeypatch.setattr(peaks_module, "_memo", {})
    monkeypatch.setattr(peaks_module, "_read", lambda path: {})  # a machine never measured
    quick = peaks_module.measure(torch.device("cpu"), torch.float32, peaks_module.QUICK)
    measured = []
    monkeypatch.setattr(peaks_module, "measure", lambda *a: measured.append(a) or quick)
    stages: list[str] = []
    for _ in range(2):
        load_model(LoadRequest(str(tiny_folder)), lambda stage, fraction: stages.append(stage))
    assert len(measured) == 1  # the second load finds them in memory
    assert stages.count("Measuring this machine's peak speeds (once)") == 1
    assert stages.index("Measuring this machine's peak speeds (once)") < stages.index("Ready")


@pytest.mark.parametrize(
    ("flags", "arithmetic"),
    [({"avx512f", "avx512_vnni"}, torch.float32), ({"avx512f", "avx512_bf16"}, torch.bfloat16)],
)
def test_a_bf16_roof_is_float32s_where_the_cpu_widens_bf16(monkeypatch, flags, arithmetic):
    """Without bf16 dot products torch widens bf16 to float32 to multiply it, so bf16's rate
    there is a conversion's, under the machine's ceiling: the roof is float32's matmul (the
    fast model's prompt multiplies in float32 there too). With them, bf16's own."""
    monkeypatch.setattr(ggml_kernel, "cpu_flags", lambda: frozenset(flags))
    ggml_kernel.dense_dtype.cache_clear()
    timed: list[torch.dtype] = []
    real = peaks_module._matmul_seconds

    def spy(n: int, device: torch.device, dtype: torch.dtype, at_least_s: float) -> float:
        timed.append(dtype)
        return real(n, device, dtype, at_least_s)

    monkeypatch.setattr(peaks_module, "_matmul_seconds", spy)
    try:
        measured = peaks_module.measure(torch.device("cpu"), torch.bfloat16, peaks_module.QUICK)
        assert timed == [arithmetic] and measured.dtype == "bfloat16"
        assert f"{str(arithmetic).removeprefix('torch.')} matmuls" in measured.method
        timed.clear()
        peaks_module.measure(torch.device("cpu"), torch.float32, peaks_module.QUICK)
        assert timed == [torch.float32]
    finally:
        ggml_kernel.dense_dtype.cache_clear()
