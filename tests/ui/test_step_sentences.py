"""Each panel's sentence about a step, checked against the numbers it is built from."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from app.bench import synthetic
from app.bench.synthetic import SyntheticSession
from engine.events import Peaks, PrefillDone, Roofline, Token
from engine.kv_formula import formula_bytes
from engine.settings import Message, ProbeSettings
from ui.panels.state import InternalsState
from ui.panels.state.explain import attention_line, kv_line, timing_line, tokens_line
from ui.panels.state.sentences import (
    attention_sentence,
    kv_formula,
    kv_sentence,
    prompt_token_sentence,
    reply_token_sentence,
    roofline_sentence,
    size_text,
    timing_sentence,
)

# SmolLM2-135M's shapes: 30 layers, 3 KV heads of 64, 2-byte values.
SMOL = synthetic.model_info(layers=30, heads=9, kv_heads=3, head_dim=64)
SMOL = replace(SMOL, dtype="bfloat16", bytes_per_value=2)
PEAKS = Peaks(1e11, 1e10, "bfloat16", "cpu", "measured")


def test_the_kv_sentence_says_the_measured_growth_and_its_formula():
    added = formula_bytes(SMOL, 13) - formula_bytes(SMOL, 12)  # one more position
    assert SMOL.bytes_per_value == 2 and kv_formula(SMOL) == added == 23_040
    assert kv_sentence(12, added, SMOL) == (
        "Step 12 appended one key and one value per layer: 23,040 bytes"
        " = 2 × 30 layers × 3 KV heads × 64 × 2 bytes"
    )


def test_a_growth_the_formula_does_not_explain_is_said_as_measured():
    sentence = kv_sentence(5, 30_720, SMOL)
    assert sentence.startswith("Step 5 grew the cache by 30,720 bytes")
    assert "= 23,040 bytes" in sentence


def test_the_roofline_sentence_splits_weights_from_cache_and_says_the_bound():
    info = synthetic.model_info(layers=30, kv_heads=3, head_dim=64, peaks=PEAKS)
    info = replace(info, weight_bytes=84_000_000)
    flops = 272_000_000
    moved = 84_000_000 + 1_100_000
    step = Roofline(flops, moved, flops / moved, 1e9, 1e9, "memory")
    assert roofline_sentence(12, step, info) == (
        f"Step 12 read 84 MB of weights and moved 1.1 MB of KV cache to make one token:"
        f" {flops / moved:.1f} FLOP per byte, memory-bound"
    )


def test_without_a_split_or_peaks_the_roofline_sentence_says_only_what_it_knows():
    step = Roofline(1000, 500, 2.0, 1.0, 1.0, "memory")
    assert roofline_sentence(3, step, SMOL) == (
        "Step 3 moved 500 bytes to make one token: 2.0 FLOP per byte"
    )


def test_the_attention_sentence_names_the_key_with_most_weight():
    weights = np.array([0.1, 0.04, 0.25, 0.61], dtype=np.float32)  # query at position 4
    assert attention_sentence(0, 4, weights, 4, "the") == (
        "Head 4 of layer 0 gave 61% of its weight to the previous token 'the'"
    )
    assert attention_sentence(0, 4, weights, 6, "the").endswith("to token #3, 3 back 'the'")
    assert "itself" in attention_sentence(1, 0, weights, 3, "x")
    assert "the first token" in attention_sentence(1, 0, np.array([0.9, 0.1]), 5, "x")


def test_the_timing_sentence():
    assert timing_sentence(7, 0.04, 0.05) == (
        "Step 7 took 40.0 ms, 25.0 tokens a second at this pace (mean step so far 50.0 ms)"
    )
    assert size_text(46_080) == "46 kB" and size_text(1_100_000) == "1.1 MB"


def replied_state(pieces=(" a", " b", " c", " d")) -> InternalsState:
    """A state fed one synthetic reply, its attention watched on layers 0 and 1."""
    info = synthetic.model_info(layers=2, heads=4, kv_heads=2, head_dim=16)
    session = SyntheticSession(info, pieces, step_s=0.02)
    state = InternalsState()
    state.set_model(info)
    probes = ProbeSettings(attention_layers=(0, 1), top_k=5)
    for event in session.generate([Message("user", "one two three")], None, probes):
        state.ingest(event)
    return state


def test_the_lines_speak_of_the_selected_step_with_its_events_numbers():
    state = replied_state()
    prompt = state.prompt_tokens
    state.select(prompt + 2)  # the reply's third token: made by decode step 2
    assert state.selected_step == 2
    added = state.step_kv_bytes[2] - state.step_kv_bytes[1]
    assert added == kv_formula(state.info)
    assert kv_line(state) == kv_sentence(2, added, state.info)
    decode = state.step_seconds[1:]
    assert timing_line(state) == timing_sentence(2, state.step_seconds[2], sum(decode) / 3)
    # Step 2's query is the token before it; its row is the one the engine sent for step 2.
    row = state.attention[0].row_at(prompt + 1)
    head = 1
    key = int(row[head].argmax())
    line = attention_line(state, 0, head)
    assert line.startswith(f"Step 2 (query #{prompt + 1}): Head 1 of layer 0 gave")
    assert f"{row[head, key]:.0%} of its weight" in line


def test_a_prompt_token_selects_the_prefill():
    state = replied_state()
    state.select(1)
    assert state.selected_step is None
    assert kv_line(state).startswith("Token #1 is in the prompt")
    assert f"{state.prefill_kv_bytes:,} bytes" in kv_line(state)
    assert timing_line(state) == ""
    assert attention_line(state, 0, None).startswith("Prompt token #1: Head")


def test_the_latest_step_is_followed_until_a_token_is_chosen():
    state = replied_state()
    assert state.selected_position == len(state.trail.ids) - 1
    assert state.selected_step == 3
    state.select(None)
    assert state.selected_step == 3
    state.select(10_000)  # past the context: ignored
    assert state.selected is None


def test_the_token_sentences_name_the_id_its_text_or_bytes_and_the_prompt():
    assert reply_token_sentence(12, 1234, " the", 1101, 0) == (
        "Step 12 produced token 1,234 ' the' after 1,101 prompt tokens, 0 reused"
    )
    assert reply_token_sentence(3, 226, "<0xE2>", 20, 8) == (
        "Step 3 produced token 226 <0xE2> (1 byte of a character split across tokens)"
        " after 20 prompt tokens, 8 reused"
    )
    assert "(2 bytes of a character" in reply_token_sentence(3, 9, "<0xE2><0x80>", 20, 8)
    assert prompt_token_sentence(0, 1, "<|im_start|>", True, 24, 20) == (
        "Prompt token #0 is token 1 '<|im_start|>', a special token of the chat template,"
        " reused from the cache (24 prompt tokens, 20 reused)"
    )
    assert "processed by the prefill" in prompt_token_sentence(22, 5, "x", False, 24, 20)


def test_the_tokens_line_is_the_selected_tokens_event():
    info = synthetic.model_info(layers=2, heads=4, kv_heads=2, head_dim=16)
    session = SyntheticSession(info, (" a", " b", " c"), step_s=0.0)
    state = InternalsState()
    state.set_model(info)
    events = list(session.generate([Message("user", "one two")], None, ProbeSettings()))
    for event in events:
        state.ingest(event)
    second = next(e for e in events if isinstance(e, Token) and e.index == 1)
    prefill = events[0]
    assert isinstance(prefill, PrefillDone)
    state.select(state.prompt_tokens + 1)
    assert tokens_line(state) == (
        f"Step 1 produced token {second.token_id:,} {second.piece!r} after"
        f" {prefill.prompt_tokens:,} prompt tokens, {prefill.reused_tokens:,} reused"
    )
