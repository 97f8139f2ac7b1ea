"""The compiled decode step (engine/step/compiled.py): built, saved and loaded for a tiny
Llama-shaped GGUF, held against the eager step it replaces; its probes; its fallbacks; and on
the bundled model, against the exact model teacher-forced."""

from __future__ import annotations

import hashlib
import inspect
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.torch_version import TorchVersion

from app.bench import speed as benchmark
from engine.disk import build_lock
from engine.disk.cache_folder import default_cache_dir
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel, describe_fast
from engine.model.attention_probe import AttentionProbe
from engine.model.kv_buffer import KVBuffer, WindowedKVBuffer
from engine.model.llama import GGUFLlama, QKNormAttention
from engine.settings import Message
from engine.step import compiled as compiled_decode
from engine.step import flat
from engine.step.compiled import Attacher
from engine.weights import ggml_kernel
from engine.weights import linear as quant
from tests.engine.model.test_fast import decoded_against_exact, hf_model
from tests.engine.model.test_gemma import gemma
from tests.engine.step.compiling import build, needs_a_compiler
from tests.engine.weights.test_linear import mixed_gguf
from tests.gguf_files import Q4_1, Q5_0, Q6_K, Q8_0, write_gguf


class RequantizedLinear(torch.nn.Module):
    """A stand-in for a weight layout the compiled step has no kind for."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.t()


STEPS = 40  # decode steps compared: past two growths of a 16-position cache
# The compiled step fuses the norms and the rotation into its own loops, so bf16 activations
# round differently from the eager ops by about one bf16 step. The tiny model's logits are
# below 1, where a bf16 step is 0.004 (measured: at most one step apart); the bundled model's
# are ~20 (measured there: max |Δlogit| 0.2-0.5 with the top-1 unchanged).
LOGIT_ATOL = 8e-3
ATTENTION_ATOL = 5e-3


def small_cache(model: GGUFLlama) -> KVBuffer:
    shape = model.shape
    return KVBuffer(shape.layers, shape.kv_heads, shape.head_dim, model.cache_dtype,
                    model.device, chunk=16)  # fmt: skip


def small_windowed_cache(model: GGUFLlama) -> WindowedKVBuffer:
    """Gemma's own cache with small chunks, so that its sliding layers move their window to
    the front within a few steps."""
    s = model.shape
    return WindowedKVBuffer(
        s.layers, s.kv_heads, s.head_dim, model.cache_dtype, model.device,
        sliding=s.sliding_layers, window=s.sliding_window, chunk=16,
    )  # fmt: skip


def decode(model: GGUFLlama, tokens: list[int], layers: frozenset[int], compiled: bool,
           new_cache: Callable[[GGUFLlama], KVBuffer] = small_cache):  # fmt: skip
    """Prefill 5 tokens, then one step per remaining token; each step's logits and probe.
    `compiled=False` runs the eager step with the compiled one set aside meanwhile."""
    step, cache = model.decode_step, new_cache(model)
    if not compiled:
        model.decode_step = None
    try:
        model.forward(torch.tensor([tokens[:5]]), cache, None)
        out = []
        for token in tokens[5:]:
            probe = AttentionProbe(layers)
            out.append((model.forward(torch.tensor([[token]]), cache, probe), probe.weights))
    finally:
        if not compiled:
            model.decode_step = step
    return out, cache


@pytest.fixture(scope="module")
def compiled_mixed(tmp_path_factory) -> GGUFLlama:
    """A Qwen2-shaped model (q/k/v biases) of every layout: q/k Q4_K with v Q6_K, gate/up Q5_0
    and Q8_0, out Q5_K (int4 halves: no GGML kernel), down Q6_K; in the GGML kernels or torch's
    int4 layouts as this CPU's kernel set has them (ggml_kernel.holds)."""
    needs_a_compiler()
    model = build(mixed_gguf(tmp_path_factory.mktemp("gguf") / "mixed.gguf", Q6_K))
    assert compiled_decode.refusal(model) is None
    path = tmp_path_factory.mktemp("compiled") / "mixed.pt2"
    compiled_decode.compile_to(model, path)
    model.decode_step = compiled_decode.load(path, model)
    return model


def test_compiled_steps_follow_the_eager_steps(compiled):
    assert_follows_the_eager_steps(compiled[0])


def test_compiled_steps_of_biases_and_mixed_layouts_follow_the_eager_steps(compiled_mixed):
    plans = compiled_decode.layer_plan(compiled_mixed)
    kinds = {kind for plan in plans for linear in plan.linears for kind in linear}
    q6 = "int4 per 16" if quant.kernel_block_rows() == 64 else "bf16"  # Q6_K's, per kernel set
    held = ggml_kernel.holds  # the types the GGML kernels hold on this CPU (their own kind)
    q4_k = "ggml 12" if held(quant.Q4_K) else "int4"
    q5_0 = "ggml 6" if held(quant.Q5_0) else "int4 halves"  # gate
    q8_0 = "ggml 8" if held(quant.Q8_0) else "int4 halves"  # up; out's Q5_K is always halves
    assert kinds == {q4_k, q5_0, "int4 halves", q8_0, "ggml 14" if held(quant.Q6_K) else q6}
    assert all(plan.bias for plan in plans)
    # Its K-quant weights are random blocks sized like a model's, its logits up to ~3 (the
    # tiny Q4_1 model's stay below 1): the compiled step's own bf16 roundings (fused bias
    # and halves' adds) move a few logits by up to a few bf16 steps at that size; its q·k
    # scores reach ~100 (weights of 1e-36 beside 0.75), where a bf16 step of a key moves
    # the weights of two close keys by a few hundredths (measured up to 0.035).
    assert_follows_the_eager_steps(compiled_mixed, logit_steps=16, attention_atol=0.06)


def assert_follows_the_eager_steps(
    model: GGUFLlama,
    logit_steps: int = 0,
    attention_atol: float = ATTENTION_ATOL,
    new_cache: Callable[[GGUFLlama], KVBuffer] = small_cache,
) -> None:
    seeded = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.shape.vocab, (5 + STEPS,), generator=seeded).tolist()
    layers = frozenset(range(model.shape.layers))
    fast, fast_cache = decode(model, tokens, layers, compiled=True, new_cache=new_cache)
    eager, eager_cache = decode(model, tokens, layers, compiled=False, new_cache=new_cache)
    assert model.decode_step is not None  # no step fell back to eager on the way
    assert fast_cache.length == eager_cache.length == len(tokens)
    full = min(set(range(model.shape.layers)) - set(model.shape.sliding_layers))
    assert fast_cache.keys[full].shape[2] == 48  # grown twice by 16 positions, in place
    for (logits, attention), (reference, reference_attention) in zip(fast, eager, strict=True):
        atol = max(LOGIT_ATOL, logit_steps * reference.abs().max().item() / 256)
        torch.testing.assert_close(logits, reference, atol=atol, rtol=0)
        for layer in layers:
            rows = attention[layer]
            assert rows.shape == reference_attention[layer].shape
            np.testing.assert_allclose(rows, reference_attention[layer], atol=attention_atol)
            torch.testing.assert_close(rows.sum(-1), torch.ones(rows.shape[:-1]))
    end = len(tokens)
    for layer in range(model.shape.layers):  # the keys a next query sees (a window, if slides)
        torch.testing.assert_close(
            fast_cache.held(layer, end - 1, end)[0].float(),
            eager_cache.held(layer, end - 1, end)[0].float(),
            atol=0.05,  # a bf16 step at the keys' size
            rtol=0.02,
        )


def test_a_saved_step_is_loaded_by_the_attacher(compiled, tiny_gguf):
    model, path = compiled
    fresh = build(tiny_gguf)
    temporary = list(Path(tempfile.gettempdir()).glob("aotinductor_*"))
    attacher = Attacher(fresh, tiny_gguf, path, default_cache_dir()).start()
    assert attacher.done.wait(120)
    assert attacher.error is None and fresh.decode_step is not None
    # loaded from its files unpacked beside it: nothing in the temporary folder to outlive
    # an engine process that is stopped
    assert list(Path(tempfile.gettempdir()).glob("aotinductor_*")) == temporary
    assert (path.parent / (path.name + compiled_decode.UNPACKED)).is_dir()
    tokens = list(range(100, 112))
    fresh_out, _ = decode(fresh, tokens, frozenset(), compiled=True)
    model_out, _ = decode(model, tokens, frozenset(), compiled=True)
    for (a, _), (b, _) in zip(fresh_out, model_out, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # the same function, the same weights


def test_the_benchmark_times_the_compiled_step_and_the_eager_one_beside(
    compiled, tiny_gguf, tokenizer, monkeypatch
):
    _, path = compiled
    model = build(tiny_gguf)
    attacher = Attacher(model, tiny_gguf, path, default_cache_dir()).start()
    loaded = LoadedModel(model, tokenizer, describe_fast(model, "llama.gguf", "gguf"), attacher)
    report = benchmark.wait_for_compiled(loaded)  # waits until it is attached
    assert report["decode_step"] == "compiled" and report["waited_s"] >= 0
    steps_seen = []
    layers = GGUFLlama._layers

    def recording(self, *args):
        steps_seen.append(self.decode_step)
        return layers(self, *args)

    monkeypatch.setattr(GGUFLlama, "_layers", recording)
    finished = benchmark.eager_run(ChatSession(loaded), [Message("user", "Hi")], 4)
    assert finished.generated_tokens == 4 and steps_seen and set(steps_seen) == {None}
    assert model.decode_step is attacher.model.decode_step is not None  # set back afterwards


def test_a_load_that_builds_no_step_uses_a_kept_one_only(compiled, tiny_gguf, tmp_path,
                                                          monkeypatch):  # fmt: skip
    from engine.load.gguf_fast import compile_in_background
    from engine.load.tokenizer import file_key
    from engine.settings import LoadRequest

    monkeypatch.setenv("GLASSBOX_COMPILE", "1")
    _, kept = compiled
    request = LoadRequest(precision="fast", build_compiled=False)
    fresh = build(tiny_gguf)
    assert compile_in_background(fresh, tiny_gguf, tmp_path, request) is None  # none kept
    threads = torch.get_num_threads()
    path = compiled_decode.artifact_path(tmp_path / "compiled", tiny_gguf.stem,
                                         file_key(tiny_gguf), threads, fresh)  # fmt: skip
    path.parent.mkdir()
    shutil.copy(kept, path)
    attacher = compile_in_background(fresh, tiny_gguf, tmp_path, request)
    assert attacher is not None and attacher.done.wait(60)
    assert attacher.state == "compiled" and fresh.decode_step is not None


def test_a_failed_compile_leaves_the_eager_step_and_says_why(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(compiled_decode, "LOW_PRIORITY", [])  # not left waiting for idle CPU
    model = build(tiny_gguf)
    missing = tmp_path / "missing.gguf"
    attacher = Attacher(model, missing, tmp_path / "step.pt2", tmp_path).start()
    assert attacher.done.wait(300)
    assert attacher.error is not None and "compiling exited" in attacher.error
    assert model.decode_step is None and not (tmp_path / "step.pt2").exists()


def test_a_damaged_package_leaves_the_eager_step_and_says_why(tiny_gguf, tmp_path):
    if torch.__version__ < compiled_decode.MIN_TORCH:
        pytest.skip(f"torch {torch.__version__} loads no package: its refusal is tested below")
    model = build(tiny_gguf)
    damaged = tmp_path / "step.pt2"
    damaged.write_bytes(b"not a package")  # saving renames whole files: only damage does this
    attacher = Attacher(model, tiny_gguf, damaged, tmp_path).start()
    assert attacher.done.wait(60)
    assert attacher.state.startswith("eager: RuntimeError") and "zip" in attacher.state
    assert model.decode_step is None


def test_a_step_that_fails_falls_back_to_eager_for_good(tiny_gguf):
    model = build(tiny_gguf)
    calls = []

    def failing(*args):
        calls.append(args)
        raise RuntimeError("GuardManager check failed")

    eager, _ = decode(model, [5, 6, 7, 8, 9, 10, 11], frozenset({0}), compiled=False)
    model.decode_step = failing  # type: ignore[assignment]
    out, _ = decode(model, [5, 6, 7, 8, 9, 10, 11], frozenset({0}), compiled=True)
    assert len(calls) == 1 and model.decode_step is None
    for (a, probe_a), (b, probe_b) in zip(out, eager, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
        torch.testing.assert_close(probe_a[0], probe_b[0], atol=0, rtol=0)


def test_only_one_token_after_a_cached_position_goes_through_the_step(tiny_gguf):
    """A prompt's pass, a first token with nothing cached, and the no-cache mode stay eager."""
    model = build(tiny_gguf)
    calls = []

    def recording(x, ropes, start, cache):
        calls.append(start)
        raise RuntimeError("recorded")

    model.decode_step = recording  # type: ignore[assignment]
    cache = model.new_cache()
    model.forward(torch.tensor([[5]]), cache, None)  # start 0
    model.forward(torch.tensor([[5, 6, 7]]), cache, None)  # a prompt
    model.forward(torch.tensor([[5, 6, 7, 8]]), None, None)  # no cache
    assert calls == [] and model.decode_step is recording
    model.forward(torch.tensor([[9]]), cache, None)
    assert calls == [4]


class EagerDecode(compiled_decode.CompiledDecode):
    """The step's ops (decode_layers) run eagerly on the inputs CompiledDecode passes."""

    def __init__(self, model: GGUFLlama) -> None:
        super().__init__(None, model)  # type: ignore[arg-type]  # no package: run() below
        self.plan = compiled_decode.layer_plan(model)

    def run(self, inputs):
        return compiled_decode.decode_layers(*inputs, self.plan)


def test_the_steps_qk_norm_follows_the_eager_steps(tmp_path):
    """Qwen3's QK-norm in the step's flat ops (run eagerly here; the compiled tests above hold
    the compiled ops to the same flat ops)."""
    model = build(write_gguf(tmp_path / "qwen3.gguf", hf_model("qwen3"), Q4_1, Q8_0))
    assert all(plan.qk_norm for plan in compiled_decode.layer_plan(model))
    model.decode_step = EagerDecode(model)
    assert_follows_the_eager_steps(model)


GEMMA_SCALE = 32**-0.5  # a q·k scale other than head_dim ** -0.5 (as on Gemma 3 27B)


def build_gemma(path: Path) -> GGUFLlama:
    """test_gemma's tiny Gemma 3 (sliding layers of a window of 8, a global one, random norms)
    in mixed layouts: v in Q8_0 and the gate in Q5_0 (the GGML kernels' kinds where they hold
    them), the rest Q4_1; its attention scaled by GEMMA_SCALE (eager and step alike)."""
    types = {"attn_v.weight": Q8_0, "ffn_gate.weight": Q5_0}
    model = build(write_gguf(path, gemma(), Q4_1, Q8_0, types=types))
    for block in model.blocks:
        block.attention.scale = GEMMA_SCALE
    return model


@pytest.fixture(scope="module")
def compiled_gemma(tmp_path_factory) -> GGUFLlama:
    needs_a_compiler()
    model = build_gemma(tmp_path_factory.mktemp("gguf") / "gemma3.gguf")
    assert compiled_decode.refusal(model) is None
    path = tmp_path_factory.mktemp("compiled") / "gemma3.pt2"
    compiled_decode.compile_to(model, path)
    model.decode_step = compiled_decode.load(path, model)
    return model


def assert_a_gemma_plan(model: GGUFLlama) -> None:
    """Every Gemma 3 feature in the step's plan, so the step below runs them all."""
    shape, plans = model.shape, compiled_decode.layer_plan(model)
    assert {plan.window for plan in plans} == {0, shape.sliding_window}
    assert all((plan.rope == 1) == (plan.window > 0) for plan in plans)  # the local base
    assert all(plan.form.gelu and plan.qk_norm for plan in plans)
    assert all("post_ffn_norm" in plan.weights for plan in plans)
    assert all(plan.scale == GEMMA_SCALE != shape.head_dim**-0.5 for plan in plans)


def test_gemma_decodes_through_the_compiled_step_as_eagerly(compiled_gemma):
    """Gemma 3's layers compiled: logits and every layer's probe against the eager steps,
    through its own cache (the sliding layers' window moved to the front on the way) and
    through a plain one."""
    assert_a_gemma_plan(compiled_gemma)
    # The mixed layouts' tolerances (test_compiled_steps_of_biases_and_mixed_layouts...):
    # Gemma rounds to bf16 at more places a layer than Llama (four norms, the QK-norm), each
    # of which the compiled step fuses into its own loops, and a key a bf16 step apart moves
    # every later step: measured up to 0.025 apart at a logit of 0.49 on 1 of 49,152 logits
    # (largest logit 0.66), where the tiny Llama's stay within one bf16 step.
    tolerances = {"logit_steps": 16, "attention_atol": 0.06}
    assert_follows_the_eager_steps(compiled_gemma, new_cache=small_windowed_cache, **tolerances)
    cache = decode(compiled_gemma, list(range(5 + STEPS)), frozenset(), True,
                   small_windowed_cache)[1]  # fmt: skip
    assert cache.offset > 0  # the step wrote past a move of the window
    assert_follows_the_eager_steps(compiled_gemma, **tolerances)


def test_gemmas_flat_ops_follow_the_eager_steps_in_torchs_kernels(tmp_path, monkeypatch):
    """The step's ops without the GGML kernels (inductor's attention loops, int4 layouts),
    run eagerly: the compiled test above runs the GGML kernels where this CPU has them."""
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "0")
    model = build_gemma(tmp_path / "gemma3.gguf")
    assert_a_gemma_plan(model)
    assert not any(plan.attention_kernel for plan in compiled_decode.layer_plan(model))
    model.decode_step = EagerDecode(model)
    assert_follows_the_eager_steps(model, new_cache=small_windowed_cache)


def test_models_the_step_cannot_run_are_refused(tmp_path, monkeypatch):
    qwen = build(write_gguf(tmp_path / "qwen2.gguf", hf_model("qwen2"), Q4_1, Q8_0))
    monkeypatch.setattr(torch, "__version__", TorchVersion(compiled_decode.MIN_TORCH + ".0"))
    assert compiled_decode.refusal(qwen) is None  # its biases are in the step
    block = qwen.blocks[0]
    weight = block.feed_forward.down.dense().float()
    block.feed_forward.down = RequantizedLinear(weight)  # a layout the step does not know
    assert "RequantizedLinear weights are not in" in (compiled_decode.refusal(qwen) or "")
    qwen3 = build(write_gguf(tmp_path / "qwen3.gguf", hf_model("qwen3"), Q4_1, Q8_0))
    assert compiled_decode.refusal(qwen3) is None  # its QK-norm is in the step
    qwen3.blocks[0].attention.__class__ = type("OtherAttention", (QKNormAttention,), {})
    assert "OtherAttention is not in" in (compiled_decode.refusal(qwen3) or "")
    llama = build(write_gguf(tmp_path / "llama.gguf", hf_model("llama"), Q4_1, Q8_0))
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.11.0+cu130"))
    assert "older than" in (compiled_decode.refusal(llama) or "")
    assert not compiled_decode.can_save_compiled()
    monkeypatch.setenv("GLASSBOX_COMPILE", "0")
    assert compiled_decode.disabled() is not None
    monkeypatch.setenv("GLASSBOX_COMPILE", "1")
    assert compiled_decode.disabled() is None


def test_the_artifact_is_named_by_file_torch_cpu_plan_threads_and_version(
    tiny_gguf, tmp_path, monkeypatch
):
    model = build(tiny_gguf)
    path = compiled_decode.artifact_path(tmp_path, "model", "abc123", 3, model)
    assert path.parent == tmp_path and "-3t-" in path.name
    assert path.name.startswith("model-abc123-torch" + torch.__version__.replace("+", "-"))
    assert torch.backends.cpu.get_cpu_capability().lower() in path.name
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "0")  # the same file in other layouts
    int4 = build(tiny_gguf)
    if compiled_decode.layer_plan(int4) != compiled_decode.layer_plan(model):
        assert compiled_decode.artifact_path(tmp_path, "model", "abc123", 3, int4) != path

    assert path.name.endswith(f"-v{compiled_decode.STEP_VERSION}.pt2")
    monkeypatch.setattr(compiled_decode, "STEP_VERSION", compiled_decode.STEP_VERSION + 1)
    assert compiled_decode.artifact_path(tmp_path, "model", "abc123", 3, model) != path


# The step's code as STEP_VERSION was last set for: (STEP_VERSION, a hash of step_source()).
PINNED = (4, "329f788437d2")


def step_source() -> str:
    """The code a package is built from and called with: the one layer, the compiled step's
    module, and what its inputs are read from."""
    from engine.model import layer
    from engine.model.llama import Block

    parts = (layer, flat, compiled_decode, Block.weights, Block.linears,
             quant.interleave_q6)  # fmt: skip
    return "".join(inspect.getsource(part) for part in parts)


def test_the_step_version_is_pinned_to_the_steps_code():
    code = hashlib.sha256(step_source().encode()).hexdigest()[:12]
    assert (compiled_decode.STEP_VERSION, code) == PINNED, (
        f"The compiled step's code changed (its hash is now {code}). If a package built before "
        "would compute anything else or take other inputs, bump STEP_VERSION in "
        "engine/step/compiled.py (every user rebuilds the step once); either way set PINNED in "
        f"this file to (STEP_VERSION, {code!r})."
    )


def test_saving_a_step_removes_the_ones_no_run_can_load(tiny_gguf, tmp_path):
    model = build(tiny_gguf)

    def named(threads: int) -> Path:
        return compiled_decode.artifact_path(tmp_path, "model", "abc123", threads, model)

    kept_1t, saved_2t = named(1), named(2)
    code = saved_2t.stem.rsplit("-", 1)[-1]
    older_code = tmp_path / saved_2t.name.replace(code, "0123456789ab")
    older_torch = tmp_path / saved_2t.name.replace("-torch", "-torch1.0.0-x")
    other_file = compiled_decode.artifact_path(tmp_path, "model", "def456", 2, model)
    for path in (kept_1t, saved_2t, older_code, older_torch, other_file):
        path.write_bytes(b"step")
        (path.parent / (path.name + compiled_decode.UNPACKED)).mkdir()
    partial = build_lock.partial_folder(saved_2t, pid=1)  # another process's build: its own
    partial.mkdir()
    compiled_decode.remove_stale(saved_2t)
    # the unpacked files go with their packages, and saved_2t's were of the package before
    unpacked = [p.parent / (p.name + compiled_decode.UNPACKED) for p in (kept_1t, other_file)]
    assert sorted(tmp_path.iterdir()) == sorted([kept_1t, saved_2t, other_file, *unpacked, partial])


# -- the bundled model ---------------------------------------------------------------------------


@pytest.mark.bundled
def test_compiled_decode_steps_follow_exact_teacher_forced(bundled, bundled_compiled):
    """test_fast's decode-path check, through the compiled step (measured: 98.8% top-1,
    mean |Δp| 0.0011 over the top 10; the eager step on the same run: 99.0%, 0.0011)."""
    model = bundled_compiled.model
    agreement, delta, _ = decoded_against_exact(bundled, model, tokens=520)
    assert model.decode_step is not None  # every step after the first went through it
    assert agreement >= 0.97, agreement
    assert delta <= 0.005, delta


def test_a_batch_of_compiled_steps_weighs_its_queries_as_each_step_did(compiled, tokenizer,
                                                                        monkeypatch):  # fmt: skip
    """A reply through the compiled step leaves each watched layer's query to its batch of
    steps (engine/generate/view_batch.py), which weighs the batch's queries at once: the rows
    and their statistics equal those weighed step by step."""
    from engine.settings import GenerationSettings, ProbeSettings
    from tests.engine.step.view_batches import assert_batches_weigh_as_steps, reply

    model, _ = compiled
    loaded = LoadedModel(model, tokenizer, describe_fast(model, "llama.gguf", "gguf"))
    probes = ProbeSettings(attention_layers=tuple(range(model.shape.layers)), top_k=5)
    settings = GenerationSettings(greedy=True, max_new_tokens=24, ignore_eos=True)
    blocks: list[int] = []
    weigh = GGUFLlama.weigh

    def counted(self, layer, queries, start, cache):
        blocks.append(queries.shape[2])
        return weigh(self, layer, queries, start, cache)

    monkeypatch.setattr(GGUFLlama, "weigh", counted)
    alone = reply(loaded, settings, probes, batched=False, monkeypatch=monkeypatch)
    assert blocks and set(blocks) == {1}
    blocks.clear()
    batched = reply(loaded, settings, probes, batched=True, monkeypatch=monkeypatch)
    assert max(blocks) == 23  # every decode step's query in one block per layer
    assert_batches_weigh_as_steps(alone, batched, probes.attention_layers)
