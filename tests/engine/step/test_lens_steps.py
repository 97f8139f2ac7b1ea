"""The logit lens on the fast decode steps: the CPU's compiled step and the static step
(uncaptured on the CPU, as test_static runs it) return each layer's output, and a watched
lens keeps it from them, with no eager pass, equal to the eager step's lens for the same
tokens."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.events import LayerLens, Peaks, Token
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel, describe_fast
from engine.model.lens import LayerLensProbe
from engine.model.llama import GGUFLlama
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.step import compiled as compiled_decode
from engine.step.static import CAPTURE, EAGER, StaticDecode
from tests.engine.model.test_gemma import gemma
from tests.engine.step.compiling import build
from tests.engine.step.test_compiled import EagerDecode
from tests.engine.step.test_static import DEVICES_HERE, recorded_first
from tests.engine.step.test_static import build as build_for_a_gpu
from tests.engine.step.test_static import static as static_step
from tests.gguf_files import Q4_1, Q8_0, write_gguf

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")
PROMPT, STEPS = 5, 12
# The compiled step fuses its norms and rotations into loops of its own, so its bf16
# activations round differently from the eager ops: test_compiled holds its logits within
# LOGIT_ATOL of the eager step's (two bf16 steps of 2**-8 at the tiny model's logits, below
# 1). Each layer's lens logits are the same head over a residual as close, so the same bound
# holds at every layer; a probability is then within a relative 2·LOGIT_ATOL (its own logit
# and the softmax's normaliser, each moved by at most LOGIT_ATOL). The residuals themselves
# are float32 sums of bf16 products: within a few bf16 steps of their largest value.
LOGIT_ATOL = 8e-3
PROB_RTOL = 2 * LOGIT_ATOL
RESIDUAL_STEPS = 4 * 2**-8


class Counted:
    """A decode step that counts its calls (the model's own step behind it)."""

    def __init__(self, step: Callable[..., object]) -> None:
        self.step, self.calls = step, 0

    def __call__(self, *args: object) -> object:
        self.calls += 1
        return self.step(*args)


Forced = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # residuals, lens logits, logits


def forced_lenses(model: GGUFLlama, tokens: list[int], fast: bool) -> list[Forced]:
    """Each decode step's residuals [layers, dim], lens logits [layers, vocab] and the step's
    own logits [vocab], teacher-forced
    through `tokens` with the lens watched: through the model's fast step, or (fast=False)
    its eager layers with the fast steps set aside."""
    probe = LayerLensProbe(model)
    probe.watching = True
    steps = model.decode_step, model.static_step
    if not fast:
        model.decode_step, model.static_step = None, None
    try:
        cache = model.new_cache()
        model.forward(torch.tensor([tokens[:PROMPT]], device=model.device), cache, None)
        out = []
        for token in tokens[PROMPT:]:
            with probe.capture():
                logits = model.forward(torch.tensor([[token]], device=model.device), cache, None)
            residuals = probe.residuals.take()
            assert residuals is not None and model.keep_residuals is None  # set for the pass
            out.append((residuals, probe.head.logits(residuals), logits))
    finally:
        model.decode_step, model.static_step = steps
    return out


def assert_the_same_lens(model: GGUFLlama, fast_calls: Callable[[], int]) -> None:
    """The watched fast step's lens against the eager step's, step by step, for the same
    tokens; and the fast step ran every one of those passes."""
    seeded = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, model.shape.vocab, (PROMPT + STEPS,), generator=seeded).tolist()
    before = fast_calls()
    fast = forced_lenses(model, tokens, fast=True)
    assert fast_calls() - before == STEPS  # no watched pass fell back to the eager layers
    eager = forced_lenses(model, tokens, fast=False)
    assert fast_calls() - before == STEPS
    for (residuals, lens, logits), (want_residuals, want_lens, _) in zip(fast, eager, strict=True):
        assert residuals.shape == (model.shape.layers, model.shape.dim)
        assert residuals.dtype == torch.float32
        scale = want_residuals.abs().amax(-1, keepdim=True)  # [layers, 1]
        assert ((residuals - want_residuals).abs() <= RESIDUAL_STEPS * scale).all()
        # the last layer's lens is the step's own next-token logits
        torch.testing.assert_close(lens[-1], logits, atol=1e-5, rtol=0)
        torch.testing.assert_close(lens, want_lens, atol=LOGIT_ATOL, rtol=0)
        probs, want = lens.softmax(-1), want_lens.softmax(-1)
        top = probs.topk(10, dim=-1)  # the fast lens's candidates, as the panel shows them
        torch.testing.assert_close(top.values, want.gather(-1, top.indices), rtol=PROB_RTOL, atol=0)
        assert (want.topk(10, dim=-1).values <= top.values[:, :1] * (1 + PROB_RTOL)).all()


def test_the_compiled_steps_lens_equals_the_eager_steps(compiled):
    model, _ = compiled
    step = model.decode_step
    counted = Counted(step)
    model.decode_step = counted  # type: ignore[assignment]
    try:
        assert_the_same_lens(model, lambda: counted.calls)
    finally:
        model.decode_step = step


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_the_flat_ops_lens_equals_the_eager_steps(tmp_path, architecture):
    """The step's flat ops run eagerly (what the compiled step compiles), Gemma 3's sliding
    layers and four norms included."""
    from tests.engine.model.test_fast import hf_model

    source = gemma() if architecture == "gemma3" else hf_model("llama")
    model = build(write_gguf(tmp_path / "tiny.gguf", source, Q4_1, Q8_0))
    counted = Counted(EagerDecode(model))
    model.decode_step = counted  # type: ignore[assignment]
    assert_the_same_lens(model, lambda: counted.calls)


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_the_static_steps_lens_equals_the_eager_steps(tmp_path, architecture):
    from tests.engine.model.test_fast import hf_model

    source = gemma() if architecture == "gemma3" else hf_model("llama")
    model = build_for_a_gpu(write_gguf(tmp_path / "tiny.gguf", source, Q4_1, Q8_0))
    step = StaticDecode(model, EAGER, "test", first=16)
    model.static_step = step
    calls = []
    run = step.run
    step.run = lambda *args: calls.append(1) or run(*args)  # type: ignore[method-assign]
    assert_the_same_lens(model, lambda: len(calls))


@pytest.mark.parametrize("device", DEVICES_HERE)
def test_the_lens_of_a_recorded_static_step_equals_the_eager_steps(tmp_path, device):
    """The static step as a reply runs it, its buckets recorded first: on a GPU as CUDA graphs,
    whose copy of each layer's output the lens keeps; on the CPU bound uncaptured."""
    from tests.engine.model.test_fast import hf_model

    path = write_gguf(tmp_path / "tiny.gguf", hf_model("llama"), Q4_1, Q8_0)
    model = build_for_a_gpu(path, device)
    # On a GPU the eager layers captured as CUDA graphs (no compile: seconds, not minutes)
    step = static_step(model, CAPTURE if device != "cpu" else EAGER)
    recorded_first(step)
    calls = []
    run = step.run
    step.run = lambda *args: calls.append(1) or run(*args)  # type: ignore[method-assign]
    assert_the_same_lens(model, lambda: len(calls))


def watched_reply(session: ChatSession, tokens: int) -> list[Token]:
    session.watch_lens(True)
    settings = GenerationSettings(
        greedy=True, completion=True, max_new_tokens=tokens, ignore_eos=True
    )
    events = session.generate([Message("user", "Once upon a time")], settings, ProbeSettings())
    return [e for e in events if isinstance(e, Token)]


def assert_last_layer_is_the_next_token(lens: LayerLens | None, token: Token) -> None:
    assert lens is not None and lens.token_id == token.token_id
    last = dict(zip(lens.token_ids[-1], lens.probs[-1], strict=True))
    for candidate in token.top_k:
        assert last[candidate.token_id] == pytest.approx(candidate.prob, abs=1e-6)


def test_a_watched_reply_decodes_through_the_compiled_step(compiled, tokenizer):
    """The session's own loop with the lens watched: every decode step through the compiled
    step, each step's lens kept, its last layer the Next token panel's distribution."""
    model, _ = compiled
    step = model.decode_step
    counted = Counted(step)
    model.decode_step = counted  # type: ignore[assignment]
    loaded = LoadedModel(model, tokenizer, describe_fast(model, "llama.gguf", "gguf"))
    session = ChatSession(loaded, FIXED)
    try:
        tokens = watched_reply(session, 6)
    finally:
        model.decode_step = step
    assert counted.calls == 5  # token 0 comes from the prompt's pass, the rest each a step
    assert session.lens_probe.ring.steps() == list(range(6))
    for token in tokens:
        assert_last_layer_is_the_next_token(session.layer_lens(token.index), token)


@pytest.mark.bundled
def test_the_bundled_models_compiled_lens_equals_its_eager_lens(bundled_compiled):
    """On the real model (logits ~20, where the compiled step's bf16 roundings move a logit
    by up to ~0.5: test_compiled), each layer's first guess and its probability."""
    model = bundled_compiled.model
    assert compiled_decode.refusal(model) is None and model.decode_step is not None
    tokenizer = bundled_compiled.tokenizer
    ids = tokenizer("Today's weather is so nice that we went to the beach and")["input_ids"]
    fast = forced_lenses(model, ids, fast=True)
    eager = forced_lenses(model, ids, fast=False)
    agree = total = 0
    for (_, lens, logits), (_, want_lens, _) in zip(fast, eager, strict=True):
        torch.testing.assert_close(lens[-1], logits, atol=1e-4, rtol=0)
        probs, want = lens.softmax(-1), want_lens.softmax(-1)
        agree += int((probs.argmax(-1) == want.argmax(-1)).sum())
        total += probs.shape[0]
        # a logit within 0.5: a probability within a factor e ** (2 · 0.5) of the other's
        ratio = probs.max(-1).values / want.gather(-1, probs.argmax(-1, keepdim=True))[:, 0]
        assert ((ratio > 1 / torch.e) & (ratio < torch.e)).all()
    assert agree / total >= 0.95, agree / total
