"""Checks on the real Q4_K_M models `make models` fetches (skipped where they are absent)."""

from __future__ import annotations

import statistics

import pytest
import torch

from engine.disk.cache_folder import default_cache_dir
from engine.events import Token
from engine.generate.session import ChatSession
from engine.load.loader import gguf_tokenizer, load_model
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings
from engine.text import chat_format
from engine.text.prompt import encode_chat
from tests.engine.model.test_fast import decoded_against_exact

pytestmark = pytest.mark.real_models
QUESTION = [Message("user", "What is the capital of France?")]


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_gemma_file_without_a_template_gets_gemmas_turns(real_gemma, lean):
    tokenizer = gguf_tokenizer(real_gemma, default_cache_dir(), lambda *_: None, lean=lean)
    assert not tokenizer.chat_template  # the file has none
    assert chat_format.apply(tokenizer, "gemma3") == "gemma"
    ids = encode_chat(tokenizer, QUESTION)
    # <bos> <start_of_turn> user \n ... <end_of_turn> \n <start_of_turn> model \n
    assert ids[:4] == [2, 105, 2364, 107] and ids[-5:] == [106, 107, 105, 4368, 107]
    assert chat_format.end_of_turn_ids(tokenizer) == {106}


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "transformers"])
def test_the_qwen_file_keeps_its_own_template_and_stops_at_im_end(real_qwen, lean):
    tokenizer = gguf_tokenizer(real_qwen, default_cache_dir(), lambda *_: None, lean=lean)
    assert chat_format.apply(tokenizer, "qwen2") == chat_format.OWN
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in chat_format.end_of_turn_ids(tokenizer)
    assert (
        encode_chat(tokenizer, QUESTION)[-3:]
        == tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    )


# -- the fast model against the exact one, on the real files ---------------------------------


@pytest.fixture(scope="module")
def qwen(real_qwen):
    """(exact, fast) LoadedModels of the real Qwen file: transformers on the dequantised
    weights in float32, and Glassbox's own model on its K-quants (eager steps)."""
    exact = load_model(LoadRequest(str(real_qwen), precision="exact", compiled=False))
    fast = load_model(LoadRequest(str(real_qwen), precision="fast", compiled=False))
    return exact, fast


@pytest.fixture(scope="module")
def gemma(real_gemma):
    """(exact, fast) LoadedModels of the real Gemma-3-270M file (exact: float32)."""
    exact = load_model(
        LoadRequest(str(real_gemma), precision="exact", dtype="float32", compiled=False)
    )
    fast = load_model(LoadRequest(str(real_gemma), precision="fast", compiled=False))
    return exact, fast


def test_the_gemma_base_file_keeps_the_plain_transcript(gemma):
    """It names no fine-tune: no template is guessed for it (its turns were never learned)."""
    _, fast = gemma
    assert fast.info.chat_format == chat_format.PLAIN


@pytest.mark.parametrize("models", ["qwen", "gemma"])
def test_fast_decode_steps_follow_exact_teacher_forced(models, request):
    """The issue's bar for a real model: over 520 tokens fed one at a time through the fast
    model's cache, top-1 agreement with the exact model >= 97%, mean |Δp| over its top 10
    <= 0.005 (llama.cpp on the bundled model: 96.7% and 0.0046). Qwen: Q4_K with Q6_K, q/k/v
    biases; Gemma: Q5_0/Q8_0 halves, Q4_K, Q6_K and sliding layers (its window, 512, is
    passed within the 520 tokens)."""
    exact, fast = request.getfixturevalue(models)
    agreement, delta, cache = decoded_against_exact(exact, fast.model, tokens=520)
    print(f"{models}: top-1 agreement {agreement:.4f}, mean |dp| {delta:.5f}")
    assert cache.length == 520
    assert agreement >= 0.97, agreement
    assert delta <= 0.005, delta


def test_qwen_exact_greedy_reply_is_generates(qwen):
    """Where transformers reads the file, the engine's exact greedy reply is model.generate's."""
    exact, _ = qwen
    settings = GenerationSettings(greedy=True, max_new_tokens=16)
    events = list(ChatSession(exact).generate(QUESTION, settings))
    tokens = [e.token_id for e in events if isinstance(e, Token)]
    ids = torch.tensor([encode_chat(exact.tokenizer, QUESTION)])
    generated = exact.model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
    assert tokens == generated.tolist()[: len(tokens)] and len(tokens) > 0


def test_qwen_fast_candidates_are_its_own_forward(qwen):
    """The next-token candidates a fast reply shows are the softmax of the same model's
    logits, recomputed here over the whole sequence in one eager pass."""
    _, fast = qwen
    settings = GenerationSettings(greedy=True, max_new_tokens=6)
    events = list(ChatSession(fast).generate(QUESTION, settings, ProbeSettings(top_k=5)))
    tokens = [e for e in events if isinstance(e, Token)]
    prompt = encode_chat(fast.tokenizer, QUESTION)
    sequence = prompt + [t.token_id for t in tokens[:-1]]
    logits = fast.model.forward(torch.tensor([sequence]), None, None, every_position=True)
    probabilities = logits[len(prompt) - 1 :].float().softmax(-1)
    for step, token in enumerate(tokens):
        shown = {c.token_id: c.prob for c in token.top_k}
        assert token.token_id == int(probabilities[step].argmax())
        for token_id, prob in shown.items():
            assert abs(prob - probabilities[step, token_id].item()) < 0.02, (step, token_id)


def test_qwen_fast_capped_at_half_its_size_replies_as_in_memory_and_counts_its_reads(
    qwen, real_qwen, tmp_path
):
    """Issue 25's target on the real file: Qwen at fast precision with a RAM cap of half its
    in-memory size loads (its disk the mapped file), replies with the tokens and probes of the
    same model in memory, and a step whose pages the OS dropped reads them back, the kernel's
    count within 20% of what is placed on disk, the step within 1.3x of its prediction."""
    from tests.engine.placement.test_placement import assert_same_probes

    _, fast = qwen
    request = LoadRequest(str(real_qwen), precision="fast", max_memory="cpu=500MiB",
                          compiled=False)  # fmt: skip
    placed = load_model(request, cache_dir=tmp_path)
    placement = placed.info.placement
    assert placed.info.precision == "fast" and placement.mapped
    assert dict(placement.place_bytes)["cpu"] <= 500 << 20 < placement.moved_bytes * 2
    probes = ProbeSettings(attention_layers=(0, 27), top_k=5)
    settings = GenerationSettings(greedy=True, max_new_tokens=6, ignore_eos=True)

    def reply(loaded, between=None):
        events = []
        for event in ChatSession(loaded).generate(QUESTION, settings, probes):
            events.append(event)
            if between is not None and isinstance(event, Token):
                between()  # outside the next step's clock
        return events[0], [e for e in events if isinstance(e, Token)]

    assert_same_probes(reply(fast), reply(placed))
    _, tokens = reply(placed, placed.transfers.drop_all)
    if placement.read_bytes_per_s <= 0:
        pytest.skip("the file system here gives no storage reads to count (tmpfs?)")
    for token in tokens[1:]:
        assert token.transfer.bytes == pytest.approx(placement.moved_bytes, rel=0.2)
    ratios = [t.seconds / t.transfer.predicted_step_s for t in tokens[1:]]
    assert 1 / 1.3 <= statistics.median(ratios) <= 1.3, ratios
