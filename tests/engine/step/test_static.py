"""The static decode step (engine/step/static.py), uncaptured on the CPU and captured on a
GPU where one is present: held to the eager step it replaces (tokens, logits, probes), its
buckets, its graph count, and the choice of backend."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from engine.gguf.reader import GGUFFile
from engine.model import fast_builder
from engine.model.attention_probe import AttentionProbe
from engine.model.kv_buffer import WindowedKVBuffer
from engine.model.llama import GGUFLlama
from engine.step import static as static_decode
from engine.step.static import CAPTURE, COMPILE, EAGER, StaticDecode
from tests.engine.measure.test_accelerator import DEVICES
from tests.engine.model.test_fast import hf_model
from tests.engine.step.probe_bound import probe_bound, probe_f64
from tests.gguf_files import Q4_1, Q8_0, write_gguf

STEPS = 44  # decode steps: from a 16-position bucket past 32 into the 64 one
FIRST = 16  # the smallest bucket in these tests, so that few steps cross two boundaries
PROMPT = 5
# The static step attends over the whole bucket with a mask where the eager one attends over
# the filled part: the same numbers summed in another order, within float32's rounding, and
# bf16 activations that round alike (measured: identical logits on the CPU). The probes are
# held to a float64 referee within a bound from the dtypes and reduction lengths (probe_bound).
LOGIT_ATOL = 8e-3
DEVICES_HERE = [d for d in DEVICES if d != "mps"]  # a CUDA graph or the CPU's uncaptured step


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "llama.gguf"
    return write_gguf(path, hf_model("llama"), Q4_1, Q8_0)


def build(path, device: str = "cpu") -> GGUFLlama:
    model = fast_builder.build_fast(GGUFFile(path), kernels=False)  # the GPU's form, as loaded
    if device != "cpu":
        from engine.model.to_device import to_device

        model = to_device(model, torch.device(device))
    return model


def greedy(model: GGUFLlama, layers: frozenset[int], steps: int = STEPS):
    """Prefill PROMPT tokens, then `steps` greedy steps: (tokens, logits, probe weights, the
    cache, each step's probe inputs {layer: (q, k, scale)})."""
    cache = model.new_cache()
    ids = torch.arange(3, 3 + PROMPT, device=model.device)[None]
    logits = model.forward(ids, cache, None)
    tokens, all_logits, probes, inputs = [], [], [], []
    for _ in range(steps):
        token = logits.argmax()
        tokens.append(int(token))
        probe = AttentionProbe(layers)
        with probe_inputs(model) as seen:
            logits = model.forward(token.view(1, 1), cache, probe)
        all_logits.append(logits.float().cpu())
        probes.append({k: v.cpu() for k, v in probe.weights.items()})
        inputs.append(seen)
    return tokens, all_logits, probes, cache, inputs


@contextlib.contextmanager
def probe_inputs(model: GGUFLlama):
    """{layer: (q, k, scale)} of every probe the model computes meanwhile, as it computes it."""
    seen: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
    attentions = [block.attention for block in model.blocks]
    for layer, attention in enumerate(attentions):

        def record(q, k, start, rows, layer=layer, attention=attention):
            scale = attention.scale or q.shape[-1] ** -0.5
            seen[layer] = (q.cpu(), k.cpu(), scale)
            return type(attention).probe_weights(attention, q, k, start, rows)

        attention.probe_weights = record
    try:
        yield seen
    finally:
        for attention in attentions:
            del attention.probe_weights


def assert_probes_agree(got, want, inputs, layers) -> None:
    """Both steps' probes within probe_bound of the float64 probe of one's q and k."""
    for step_got, step_want, seen in zip(got, want, inputs, strict=True):
        assert step_got.keys() == step_want.keys() == layers
        for layer in layers:
            q, k, scale = seen[layer]
            keys = step_want[layer].shape[-1]  # a sliding layer's: its window alone
            referee, bound = probe_f64(q, k, scale, keys), probe_bound(q, k, scale, keys)
            for probe in (step_got[layer], step_want[layer]):
                excess = (probe[:, -1:].double() - referee).abs() - bound
                assert excess.max() <= 0, f"layer {layer}: {excess.max():.3g} past the bound"


def static(model: GGUFLlama, backend: str = EAGER) -> StaticDecode:
    step = StaticDecode(model, backend, "test", first=FIRST, ahead=64)
    model.static_step = step
    return step


def recorded_first(step: StaticDecode) -> None:
    """On a GPU: record the buckets a reply of STEPS reaches (16, 32, 64) before it, and no
    more; on the CPU the steps are bound as they are reached."""
    step.plan(0)
    assert step.recorder.idle(timeout=600) and step.close()


@pytest.mark.parametrize("device", DEVICES_HERE)
def test_static_steps_follow_the_eager_steps_across_buckets(tiny_gguf, device):
    layers = frozenset({0, 1})
    model = build(tiny_gguf, device)
    eager = greedy(model, layers)
    backend = static_decode.choose_backend(torch.device(device))[0]
    step = static(model, backend)
    recorded_first(step)
    fast = greedy(model, layers)
    assert fast[0] == eager[0]
    for got, want in zip(fast[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    assert_probes_agree(fast[2], eager[2], eager[4], layers)
    assert fast[3].capacity == 64 and sorted(step.pool) == [16, 32, 64]
    assert step.builds == 3  # one step bound (on a GPU: recorded) per bucket


def test_a_grown_bucket_keeps_the_filled_positions(tiny_gguf):
    model = build(tiny_gguf)
    static(model)
    cache = model.new_cache()
    model.forward(torch.arange(3, 3 + 14)[None], cache, None)  # 14 positions: bucket 16
    before = [k[:, :, :14].clone() for k in cache.keys]
    assert cache.capacity == 16
    for token in (20, 21, 22):  # the third step needs position 16: bucket 32
        model.forward(torch.tensor([[token]]), cache, None)
    assert cache.capacity == 32 and cache.length == 17
    for layer, keys in enumerate(before):
        torch.testing.assert_close(cache.keys[layer][:, :, :14], keys, atol=0, rtol=0)


def test_changing_the_watched_layers_records_nothing_new(tiny_gguf):
    model = build(tiny_gguf)
    step = static(model)
    cache = model.new_cache()
    model.forward(torch.arange(3, 8)[None], cache, None)
    for layers in ({0}, {1}, {0, 1}, set(), {1}):
        probe = AttentionProbe(frozenset(layers))
        model.forward(torch.tensor([[9]]), cache, probe)
        assert probe.weights.keys() == layers
    assert step.builds == 1
    model.forward(torch.arange(3, 8)[None], model.new_cache(), None)  # a new conversation
    model.forward(torch.tensor([[9]]), model.static_step.new_cache(), None)
    assert step.builds == 1


@pytest.mark.parametrize(
    ("cuda", "triton", "backend"),
    [(False, False, EAGER), (False, True, EAGER), (True, False, CAPTURE), (True, True, COMPILE)],
)
def test_the_backend_follows_cuda_and_triton(monkeypatch, cuda, triton, backend):
    monkeypatch.setattr(static_decode, "triton_available", lambda: triton)
    device = torch.device("cuda" if cuda else "cpu")
    chosen, reason = static_decode.choose_backend(device)
    assert chosen == backend
    assert (reason is None) == (backend != EAGER)


def test_the_state_names_the_backend_and_a_failed_capture_falls_back(tiny_gguf, monkeypatch):
    model = build(tiny_gguf)
    assert StaticDecode(model, COMPILE).state == "cuda graph (torch.compile)"
    assert StaticDecode(model, CAPTURE).state == "cuda graph (captured)"

    def failing(*args):
        raise RuntimeError("no graph here")

    monkeypatch.setattr(static_decode, "captured", failing)
    step = static(model, CAPTURE)
    cache = model.new_cache()
    model.forward(torch.arange(3, 8)[None], cache, None)
    logits = model.forward(torch.tensor([[9]]), cache, None)  # uncaptured while it records
    assert logits.shape == (model.shape.vocab,)
    # The recording fails in the background, whenever its thread gets to it on a busy machine
    deadline = time.monotonic() + 60
    while step.state != "eager: RuntimeError: no graph here" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert step.state == "eager: RuntimeError: no graph here"
    assert step.close(timeout=60)


def test_a_models_own_refusal_is_said_in_the_static_steps_terms():
    class Placed:
        compile_refusal = "layers placed on disk are read in one by one, which the compiled step"

    assert static_decode.refusal(Placed()) == (  # type: ignore[arg-type]
        "layers placed on disk are read in one by one, which the static step"
    )


def test_gemma_static_steps_follow_the_eager_steps_across_buckets(tmp_path):
    """Gemma 3's layers in the static step (uncaptured here): its sliding layers masked to
    their window over a whole bucket, its local RoPE base, QK-norm, four norms, GeGLU and
    scaled embedding, against the eager steps through its windowed cache."""
    from tests.engine.model.test_gemma import SLIDING, WINDOW, gemma

    model = build(write_gguf(tmp_path / "gemma3.gguf", gemma(), Q4_1, Q8_0))
    assert static_decode.refusal(model) is None
    layers = frozenset({0, 5})  # a sliding layer and the global one
    eager = greedy(model, layers)
    assert isinstance(eager[3], WindowedKVBuffer)
    step = static(model)
    fast = greedy(model, layers)
    assert fast[0] == eager[0]
    for got, want in zip(fast[1], eager[1], strict=True):
        torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    for step_index, (got, want) in enumerate(zip(fast[2], eager[2], strict=True)):
        assert got.keys() == want.keys() == layers
        keys = PROMPT + step_index + 1
        assert 0 in SLIDING and got[0].shape[-1] == min(WINDOW, keys)  # the window's alone
        assert got[5].shape[-1] == keys
    assert_probes_agree(fast[2], eager[2], eager[4], layers)
    assert fast[3].capacity == 64 and step.builds == 3


def test_buckets_double_up_to_the_context():
    assert [static_decode.bucket_for(n, 2048) for n in (1, 256, 257, 1500, 2048)] == [
        256, 256, 512, 2048, 2048,
    ]  # fmt: skip
    assert static_decode.bucket_for(3000, 2048) == 3000  # past the context: exactly enough
    assert static_decode.bucket_for(600, 0) == 1024  # context unknown


def test_the_device_form_is_bf16_and_follows_the_int4_model(tiny_gguf):
    from engine.model.to_device import to_device
    from engine.weights.linear import DenseLinear

    reference = build(tiny_gguf)
    model = to_device(build(tiny_gguf), torch.device("cpu"))
    linears = [m for m in model.modules() if hasattr(m, "out_features") and m is not model]
    assert linears and all(type(m) is DenseLinear for m in linears)
    assert all(m.weight.dtype == torch.bfloat16 for m in linears)
    ids = torch.arange(3, 3 + PROMPT)[None]
    want = reference.forward(ids, reference.new_cache(), None)
    got = model.forward(ids, model.new_cache(), None)
    # the same weights; the int4 kernel and a bf16 matmul round their sums differently
    torch.testing.assert_close(got, want, atol=3e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's int4 kernel needs a GPU")
def test_the_cuda_int4_repack_multiplies_as_the_dequantised_weight(tiny_gguf):
    from engine.model.to_device import Int4CudaLinear, int4_fits
    from engine.weights.linear import Int4Linear

    model = build(tiny_gguf)
    linear = next(m for m in model.modules() if isinstance(m, Int4Linear) and int4_fits(m))
    cuda = Int4CudaLinear(linear, torch.device("cuda"))
    x = torch.randn(1, linear.in_features, dtype=torch.bfloat16)
    want = x.float() @ linear.dense().float().t()
    torch.testing.assert_close(cuda(x.cuda()).float().cpu(), want, atol=5e-2, rtol=2e-2)


def test_the_nibbles_cuda_repacks_are_the_cpu_weights_values(tiny_gguf):
    from engine.model.to_device import int4_fits, nibbles, pair_nibbles
    from engine.weights.linear import BLOCK, Int4Linear

    model = build(tiny_gguf)
    linear = next(m for m in model.modules() if isinstance(m, Int4Linear) and int4_fits(m))
    q = nibbles(linear)  # [out, in]
    scale, zero = linear.scales_zeros.float().unbind(-1)  # [in / 32, out]
    groups = q.float().view(q.shape[0], -1, BLOCK) - 8
    dense = (groups * scale.t()[..., None] + zero.t()[..., None]).view_as(q)
    torch.testing.assert_close(dense, linear.dense().float(), atol=1e-2, rtol=1e-2)
    paired = pair_nibbles(q)
    assert torch.equal(paired >> 4, q[:, ::2]) and torch.equal(paired & 15, q[:, 1::2])


@pytest.mark.parametrize("device", DEVICES_HERE)
def test_a_batch_of_static_steps_weighs_its_queries_as_each_step_did(
    tiny_gguf, tokenizer, device, monkeypatch
):
    """A reply through the static step (on a GPU, its recorded graphs: their queries copied
    out before the next replay) leaves the watched layers' queries to its batch of steps
    (engine/generate/view_batch.py): rows and statistics equal those weighed step by step."""
    from engine.load.loader import LoadedModel, describe_fast
    from engine.settings import GenerationSettings, ProbeSettings
    from tests.engine.step.view_batches import assert_batches_weigh_as_steps, reply

    model = build(tiny_gguf, device)
    step = static(model, static_decode.choose_backend(torch.device(device))[0])
    recorded_first(step)
    loaded = LoadedModel(model, tokenizer, describe_fast(model, "llama.gguf", "gguf"))
    probes = ProbeSettings(attention_layers=(0, 1), top_k=5)
    settings = GenerationSettings(greedy=True, max_new_tokens=STEPS, ignore_eos=True)
    alone = reply(loaded, settings, probes, batched=False, monkeypatch=monkeypatch)
    batched = reply(loaded, settings, probes, batched=True, monkeypatch=monkeypatch)
    assert_batches_weigh_as_steps(alone, batched, probes.attention_layers)


def test_one_compile_serves_every_layer_and_every_bucket(tiny_gguf):
    """A layer's weights are its compiled code's inputs and the bucket length is dynamic: the
    layers and buckets after the first run the same compiled code, not compiles of their own,
    and each step computes as the uncompiled one."""
    from torch._dynamo.testing import CompileCounter

    model = build(tiny_gguf)
    step = StaticDecode(model, EAGER, "test", first=FIRST)
    counter = CompileCounter()
    layer = static_decode.compiled_layer(backend=counter)
    try:
        for capacity in (16, 32, 64):
            keys, values = step.buffers(capacity)
            token, position = step.inputs[capacity]
            token.fill_(7)
            position.fill_(3)
            inputs = static_decode.bucket_dynamic((token, position, keys, values))
            got = static_decode.static_step(model, step.table, *inputs, layer=layer)[0]
            torch.testing.assert_close(got, step.step(*inputs)[0], atol=0, rtol=0)
        assert len(model.blocks) > 1 and counter.frame_count == 1
        assert static_decode.compiled_layer(backend=counter) is layer  # made once
    finally:
        torch._dynamo.reset()
        static_decode._compiled_layers.pop(counter)


def test_a_load_waits_for_the_first_buckets_recording_and_keeps_its_kernels(
    tiny_gguf, monkeypatch, tmp_path
):
    """Where the step is recorded (a CUDA graph, its compile the first bucket's recording),
    `attach` returns once the buckets up to AHEAD are ready: no reply runs beside a recording.
    The compiled kernels go to the cache folder, unless the user named another."""
    import os

    monkeypatch.setattr(static_decode, "choose_backend", lambda device: (CAPTURE, None))
    recorded: list[int] = []

    def slow(step, inputs, warm):
        time.sleep(0.3)
        recorded.append(inputs[2][0].shape[2])
        return lambda: step(*inputs)

    monkeypatch.setattr(static_decode, "captured", slow)
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    # what importing dynamo writes there: torch's default, not the user's choice
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    model = build(tiny_gguf)
    stages: list[str] = []
    state = static_decode.attach(
        model, kernels=tmp_path / "kernels", report=lambda stage, done: stages.append(stage)
    )
    assert state is not None
    first = static_decode.bucket_for(1, model.shape.context)
    ahead = static_decode.bucket_for(static_decode.AHEAD, model.shape.context)
    assert recorded[0] == first and recorded[-1] == ahead  # smallest first, all at load
    assert model.static_step.recorder.buckets == sorted(recorded)
    assert state.load_wait_s >= 0.3 * len(recorded)
    assert stages == ["Compiling the decode step for the GPU (kept for later starts)"]
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels")
    static_decode.keep_kernels(tmp_path / "elsewhere")  # a folder already chosen stays
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kernels")
    assert state.close(timeout=60)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor's CUDA kernels need a GPU")
def test_the_recorded_buckets_share_one_compile_on_cuda(tiny_gguf):
    """On a GPU the buckets' recordings are one compile of the layer at most (none where an
    earlier test compiled it), then captures: buckets of sizes no earlier test used."""
    from torch._dynamo.utils import counters

    model = build(tiny_gguf, "cuda")
    before = counters["stats"]["unique_graphs"]
    step = StaticDecode(model, COMPILE, first=24, ahead=96)
    model.static_step = step
    recorded_first(step)
    assert step.recorder.buckets == [24, 48, 96]
    assert counters["stats"]["unique_graphs"] - before <= 1
