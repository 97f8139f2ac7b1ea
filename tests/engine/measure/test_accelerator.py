"""The engine on a GPU (CUDA or Apple MPS): the same contract as on the CPU.

Each test runs on the CPU and on every accelerator this machine has, so the tests' own logic is
checked everywhere and the device path wherever a GPU is found. The references are computed
on the same device: `model.generate` for the tokens, an eager forward for the attention, the
cache tensors for the bytes.
"""

from __future__ import annotations

import copy
import time

import numpy as np
import pytest
import torch

from engine.events import Finished, PrefillDone, Token
from engine.generate.session import ChatSession
from engine.load.loader import ModelLoadError, load_model
from engine.measure.device import pick_device, pick_dtype
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings
from engine.text.prompt import encode_chat
from tests.models import TINY_ARCHITECTURES, make_tiny

QUESTION = [Message("user", "Why is the sky blue? Answer briefly.")]
STEPS = 12
GREEDY = GenerationSettings(greedy=True, max_new_tokens=STEPS, ignore_eos=True)


def devices() -> list[str]:
    found = ["cpu"]
    if torch.cuda.is_available():
        found.append("cuda")
    if torch.backends.mps.is_available():
        found.append("mps")
    return found


DEVICES = devices()


def on(tokenizer, architecture: str, device: str, dtype: torch.dtype = torch.float32):
    loaded = make_tiny(tokenizer, architecture)
    loaded.model.to(device=device, dtype=dtype)
    return loaded


def generate(loaded, layers=(), top_k=0, settings=GREEDY):
    session = ChatSession(loaded)
    probes = ProbeSettings(attention_layers=layers, top_k=top_k)
    events = list(session.generate(QUESTION, settings, probes))
    assert isinstance(events[-1], Finished), events[-1]
    assert isinstance(events[0], PrefillDone)
    return session, events[0], [e for e in events if isinstance(e, Token)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("architecture", TINY_ARCHITECTURES)
def test_greedy_tokens_equal_generate_on_the_device(tokenizer, architecture, device):
    loaded = on(tokenizer, architecture, device)
    _, _, tokens = generate(loaded)
    ids = torch.tensor([encode_chat(loaded.tokenizer, QUESTION)], device=device)
    out = loaded.model.generate(ids, max_new_tokens=STEPS, min_new_tokens=STEPS,
                                do_sample=False, pad_token_id=2)  # fmt: skip
    assert [t.token_id for t in tokens] == out[0, ids.shape[1] :].tolist()


@pytest.mark.parametrize("device", DEVICES)
def test_attention_and_top_k_equal_an_eager_forward_on_the_device(tokenizer, device):
    loaded = on(tokenizer, "llama", device)
    layers = tuple(range(loaded.info.layers))
    _, prefill, tokens = generate(loaded, layers, top_k=5)
    eager = copy.deepcopy(loaded.model)
    eager.set_attn_implementation("eager")
    sequence = [*prefill.prompt_token_ids, *(t.token_id for t in tokens)]
    with torch.inference_mode():
        out = eager(torch.tensor([sequence], device=device), output_attentions=True)
    prompt = prefill.prompt_tokens
    for layer in layers:
        reference = out.attentions[layer][0].float().cpu().numpy()
        np.testing.assert_allclose(
            prefill.attention[layer], reference[:, :prompt, :prompt], atol=1e-4
        )
        for token in tokens[1:]:
            query = prompt + token.index - 1
            np.testing.assert_allclose(
                token.attention[layer], reference[:, query, : query + 1], atol=1e-4
            )
    logits = out.logits[0].float().cpu()
    for token in tokens:
        top = torch.softmax(logits[prompt + token.index - 1], dim=-1).topk(5)
        assert [c.token_id for c in token.top_k] == top.indices.tolist()
        np.testing.assert_allclose([c.prob for c in token.top_k], top.values.numpy(), atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_half_precision_kv_bytes_are_the_tensors_and_the_formula(tokenizer, device):
    dtype = torch.bfloat16 if device != "mps" else torch.float16
    loaded = on(tokenizer, "llama", device, dtype)
    info = loaded.info if loaded.info.bytes_per_value == 2 else _described(loaded)
    session, prefill, tokens = generate(loaded)
    per_token = 2 * info.layers * info.kv_heads * info.head_dim * 2
    assert prefill.kv_bytes == per_token * prefill.prompt_tokens
    held = sum(
        layer.keys.numel() * layer.keys.element_size() * 2 for layer in session._cache.inner.layers
    )
    assert tokens[-1].kv_bytes == held == per_token * (prefill.prompt_tokens + STEPS - 1)
    assert all(layer.keys.device.type == device for layer in session._cache.inner.layers)


def _described(loaded):
    from engine.load.loader import describe

    loaded.info = describe(loaded.model, loaded.info.name, loaded.info.source)
    return loaded.info


@pytest.mark.parametrize("device", DEVICES)
def test_timings_are_synchronised_with_the_device(tokenizer, device):
    loaded = on(tokenizer, "llama", device)
    generate(loaded)  # warm the kernels up
    started = time.perf_counter()
    _, prefill, tokens = generate(loaded)
    wall = time.perf_counter() - started
    phases = prefill.tokenize_s + sum(t.seconds for t in tokens)
    assert all(t.seconds > 0 for t in tokens) and tokens[0].seconds >= prefill.seconds > 0
    # The phases are timed with the device synchronised at each end: they add up to the wall.
    assert 0.8 * wall <= phases <= wall


@pytest.mark.parametrize("device", DEVICES)
def test_a_saved_model_loads_onto_the_device_in_its_default_dtype(tiny_folder, tmp_path, device):
    loaded = load_model(LoadRequest(spec=str(tiny_folder), device=device), cache_dir=tmp_path)
    expected = pick_dtype(pick_device(device))
    assert loaded.info.device.startswith(device)
    assert loaded.info.dtype == str(expected).removeprefix("torch.")
    assert loaded.info.bytes_per_value == torch.tensor([], dtype=expected).element_size()
    _, _, tokens = generate(loaded)
    assert len(tokens) == STEPS


def test_fast_precision_refuses_a_device_its_weights_cannot_run_on():
    """Glassbox's own model runs on the CPU and CUDA; asked for elsewhere (Apple's GPU) it says
    so before anything loads, and `auto` takes the exact path there."""
    from engine.load.route import _runs_fast

    mps = torch.device("mps")
    with pytest.raises(ModelLoadError, match="run on the CPU or CUDA, not on mps"):
        _runs_fast(LoadRequest(precision="fast"), "tiny", mps, None)
    assert not _runs_fast(LoadRequest(), "tiny", mps, None)
    assert _runs_fast(LoadRequest(), "tiny", torch.device("cuda"), None)  # auto: fast on CUDA
