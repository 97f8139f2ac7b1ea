"""The logit lens against an independent reference: transformers' own `output_hidden_states`
through the model's final norm and lm_head, for the same tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.events import LayerLens, Peaks, Token
from engine.generate.session import ChatSession
from engine.model.lens import transformers_parts
from engine.model.step_ring import RESIDUALS, StepRing
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.models import TINY_ARCHITECTURES, make_tiny

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")
WEATHER = "Today's weather is so"


def reply(session: ChatSession, text: str, tokens: int, watch: bool = True) -> list[Token]:
    session.watch_lens(watch)
    settings = GenerationSettings(
        greedy=True, completion=True, max_new_tokens=tokens, ignore_eos=True
    )
    events = session.generate([Message("user", text)], settings, ProbeSettings(top_k=10))
    return [e for e in events if isinstance(e, Token)]


@torch.inference_mode()
def reference_probs(model, ids: list[int]) -> torch.Tensor:
    """Each layer's next-token distribution [layers, vocab] from transformers' hidden states:
    hidden_states[i + 1] is layer i's output (the last one already through the final norm,
    so the last layer is the model's own logits)."""
    _, norm, head = transformers_parts(model)
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states
    rows = [head(norm(h[:, -1:]))[0, -1] for h in hidden[1:-1]]
    logits = torch.stack([*rows, out.logits[0, -1]]).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # the model's own logits are capped already
        logits[:-1] = torch.tanh(logits[:-1] / cap) * cap
    return torch.softmax(logits, dim=-1)


def assert_matches_reference(lens: LayerLens, probs: torch.Tensor) -> None:
    assert lens.layers == probs.shape[0]
    for layer in range(lens.layers):
        expected = probs[layer].topk(10)
        got = np.array(lens.probs[layer])
        np.testing.assert_allclose(got, expected.values.numpy(), atol=1e-4)
        # the same tokens, up to ties within the tolerance
        same = probs[layer][list(lens.token_ids[layer])].numpy()
        np.testing.assert_allclose(same, got, atol=1e-4)
        chosen = probs[layer][lens.token_id]
        assert lens.chosen_probs[layer] == pytest.approx(float(chosen), abs=1e-4)
        # its rank, up to the tokens whose probability is within the tolerance of its own
        above, near = int((probs[layer] > chosen + 1e-6).sum()), (probs[layer] - chosen).abs()
        assert above <= lens.chosen_ranks[layer] <= above + int((near <= 1e-6).sum())


@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_each_layers_guess_equals_transformers_hidden_states(tokenizer, architecture):
    loaded = make_tiny(tokenizer, architecture)
    session = ChatSession(loaded, peaks=FIXED)
    tokens = reply(session, "Once upon a time", 4)
    prompt = tokenizer("Once upon a time")["input_ids"]
    for token in tokens:
        lens = session.layer_lens(token.index)
        assert lens is not None and lens.step == token.index
        assert lens.token_id == token.token_id
        ids = prompt + [t.token_id for t in tokens[: token.index]]
        assert_matches_reference(lens, reference_probs(loaded.model, ids))
        # the last layer is the Next-token panel's distribution
        last = dict(zip(lens.token_ids[-1], lens.probs[-1], strict=True))
        for candidate in token.top_k:
            assert last[candidate.token_id] == pytest.approx(candidate.prob, abs=1e-6)


def test_the_bundled_models_lens_equals_its_hidden_states(bundled, tokenizer):
    session = ChatSession(bundled, peaks=FIXED)
    tokens = reply(session, WEATHER, 3)
    prompt = tokenizer(WEATHER)["input_ids"]
    for token in tokens:
        lens = session.layer_lens(token.index)
        assert lens is not None and lens.layers == bundled.info.layers
        ids = prompt + [t.token_id for t in tokens[: token.index]]
        assert_matches_reference(lens, reference_probs(bundled.model, ids))


def test_unwatched_nothing_is_kept_and_no_hook_is_left(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    session = ChatSession(loaded, peaks=FIXED)
    reply(session, "Once upon a time", 3, watch=False)
    assert session.layer_lens(0) is None and session.lens_probe.ring.steps() == []
    reply(session, "Once upon a time", 3, watch=True)
    assert session.lens_probe.ring.steps() == [0, 1, 2]
    layers = transformers_parts(loaded.model)[0]
    assert all(not layer._forward_hooks for layer in layers)  # removed after each pass


def test_a_new_reply_replaces_the_kept_steps(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    reply(session, "Once upon a time", 4)
    reply(session, "Hello", 2)
    assert session.lens_probe.ring.steps() == [0, 1]


def test_the_ring_drops_the_oldest_steps_past_its_byte_cap():
    ring = StepRing(max_bytes=3 * 40)
    for step in range(5):
        ring.put(step, RESIDUALS, (torch.zeros(10), step))  # 40 bytes each
    assert ring.steps() == [2, 3, 4] and ring.bytes == 120
    assert ring.get(1, RESIDUALS) is None and ring.get(4, RESIDUALS)[1] == 4


@torch.inference_mode()
def exact_top1(model, ids: list[int], prompt: int) -> np.ndarray:
    """Each layer's first guess [layers, steps] at the positions whose logits chose the reply's
    tokens (the prompt's last on), from transformers' hidden states."""
    _, norm, head = transformers_parts(model)
    out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    rows = [head(norm(h[0, prompt - 1 : -1])).argmax(-1) for h in out.hidden_states[1:-1]]
    return torch.stack([*rows, out.logits[0, prompt - 1 : -1].argmax(-1)]).numpy()


# 200 decode steps and 200 lenses on the fast model, then one exact pass over the whole text:
# seconds on an idle machine, 14 minutes on a 2-core machine shared by several test runs.
@pytest.mark.timeout(1800)
def test_the_fast_lens_agrees_with_the_exact_one_over_a_long_reply(
    bundled, bundled_fast, tokenizer
):
    session = ChatSession(bundled_fast, peaks=FIXED)
    tokens = reply(session, WEATHER, 200)
    prompt = tokenizer(WEATHER)["input_ids"]
    fast = np.array([[row[0] for row in session.layer_lens(t.index).token_ids] for t in tokens])
    ids = prompt + [t.token_id for t in tokens]
    exact = exact_top1(bundled.model, ids, len(prompt))  # [layers, steps]
    agreement = float((exact == fast.T).mean())
    assert agreement >= 0.95, agreement


@pytest.mark.parametrize("architecture", ["llama", "gemma3"])
def test_the_fast_models_last_layer_is_its_next_token_distribution(
    tokenizer, tmp_path, architecture
):
    """Glassbox's own model (GGUF blocks, the Head's bulk product and exact rows), Gemma's
    sliding layers included: the lens's last layer is the Next token probe's distribution."""
    from engine.gguf.reader import GGUFFile
    from engine.load.loader import LoadedModel, describe_fast
    from engine.model.fast_builder import build_fast
    from tests.engine.model.test_gemma import gemma
    from tests.gguf_files import Q4_1, write_gguf

    source = gemma() if architecture == "gemma3" else make_tiny(tokenizer, "llama", attn="eager")
    path = write_gguf(tmp_path / "tiny.gguf", source, Q4_1, Q4_1)
    model = build_fast(GGUFFile(path))
    info = describe_fast(model, "tiny.gguf", "gguf")
    session = ChatSession(LoadedModel(model, tokenizer, info), FIXED)
    tokens = reply(session, "Once upon a time there was", 4)
    for token in tokens:
        lens = session.layer_lens(token.index)
        assert lens is not None and lens.layers == model.shape.layers
        last = dict(zip(lens.token_ids[-1], lens.probs[-1], strict=True))
        for candidate in token.top_k:
            assert last[candidate.token_id] == pytest.approx(candidate.prob, abs=1e-5)
    assert not any("forward" in block.__dict__ for block in model.blocks)  # unwrapped after
