"""The decode loop against `model.generate`, across turns, with cancel, seeds and streaming."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from engine.events import Failed, Finished, PrefillDone, Tally, Token
from engine.generate.session import ChatSession
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.text.prompt import encode_chat
from tests.models import make_tiny

GREEDY = GenerationSettings(greedy=True, max_new_tokens=20)
QUESTION = [Message("user", "What is the capital of France?")]


def run(session, messages, settings=GREEDY, probes=None):
    events = list(session.generate(messages, settings, probes))
    tokens = [e.token_id for e in events if isinstance(e, Token)]
    return events, tokens


def reference_tokens(loaded, messages, max_new_tokens):
    ids = torch.tensor([encode_chat(loaded.tokenizer, messages)])
    out = loaded.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=2)
    return out[0, ids.shape[1] :].tolist()


def test_greedy_matches_generate(tiny):
    events, tokens = run(ChatSession(tiny), QUESTION)
    assert tokens == reference_tokens(tiny, QUESTION, GREEDY.max_new_tokens)
    assert isinstance(events[0], PrefillDone) and isinstance(events[-1], Finished)
    assert events[-1].generated_tokens == len(tokens)


@pytest.mark.bundled
def test_a_tally_of_the_events_equals_the_sessions_finished(tiny):
    """What a listener tallies from the events (the window for a reply cut off with its
    engine, the panels' live rates) is what the session itself reports at the end."""
    events, _ = run(ChatSession(tiny), QUESTION)
    tally = Tally(started=time.perf_counter())
    for event in events:
        if isinstance(event, PrefillDone | Token):
            tally.add(event)
    done = events[-1]
    assert isinstance(done, Finished)
    heard = tally.finished(done.reason, done.text)
    for field in ("prompt_tokens", "reused_tokens", "generated_tokens", "tokenize_s",
                  "prefill_s", "ttft_s"):  # fmt: skip
        assert getattr(heard, field) == getattr(done, field), field
    assert heard.decode_s == pytest.approx(done.decode_s, rel=1e-9)


def test_bundled_greedy_matches_generate_and_answers(bundled):
    settings = GenerationSettings(greedy=True, max_new_tokens=24)
    events, tokens = run(ChatSession(bundled), QUESTION, settings)
    assert tokens == reference_tokens(bundled, QUESTION, 24)
    finished = events[-1]
    assert "Paris" in finished.text
    assert finished.reason == "eos"


def test_second_turn_reuses_cache_and_equals_fresh_run(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    session = ChatSession(loaded)
    first, _ = run(session, QUESTION)
    history = [*QUESTION, Message("assistant", first[-1].text), Message("user", "And Italy?")]
    second, tokens = run(session, history)
    prefill = second[0]
    prompt = encode_chat(tokenizer, history)
    assert prefill.prompt_tokens == len(prompt)
    assert prefill.reused_tokens >= first[0].prompt_tokens  # at least the first prompt
    assert prefill.processed_tokens == len(prompt) - prefill.reused_tokens
    _, fresh = run(ChatSession(loaded), history)
    assert tokens == fresh


def test_edited_history_falls_back_to_common_prefix(tokenizer):
    loaded = make_tiny(tokenizer, "qwen2")
    session = ChatSession(loaded)
    run(session, QUESTION)
    edited = [Message("user", "What is the capital of Spain?")]
    events, tokens = run(session, edited)
    common = 0
    for a, b in zip(encode_chat(tokenizer, QUESTION), encode_chat(tokenizer, edited), strict=False):
        if a != b:
            break
        common += 1
    assert events[0].reused_tokens == common
    _, fresh = run(ChatSession(loaded), edited)
    assert tokens == fresh


def test_sliding_window_model_falls_back_after_an_edit(tokenizer):
    loaded = make_tiny(tokenizer, "gemma3")  # window of 8: cannot rewind a long cache
    session = ChatSession(loaded)
    run(session, QUESTION)
    edited = [Message("user", "Tell me about Spain.")]
    events, tokens = run(session, edited)
    assert events[0].reused_tokens < events[0].prompt_tokens
    _, fresh = run(ChatSession(loaded), edited)
    assert tokens == fresh


@pytest.mark.parametrize("probes", [ProbeSettings.off(), ProbeSettings()], ids=["plain", "view"])
def test_cancel_stops_within_one_step(tokenizer, probes):
    """No step runs after Stop. With the view's data worked out in batches, the tokens decoded
    before it but not yet delivered still come (a plain reply delivers each at once)."""
    session = ChatSession(make_tiny(tokenizer, "llama"))
    settings = GenerationSettings(greedy=True, max_new_tokens=50, ignore_eos=True)
    steps = count_calls(session, "decode_one_token")
    generated, steps_at_cancel = 0, -1
    for event in session.generate(QUESTION, settings, probes):
        if isinstance(event, Token):
            generated += 1
            if event.index == 2:
                session.cancel()
                steps_at_cancel = steps[0]
        finished = event
    assert finished.reason == "cancelled"
    assert steps[0] == steps_at_cancel  # token 0 came from the prefill: index = steps
    assert generated == steps_at_cancel + 1 == finished.generated_tokens
    if not probes.top_k:
        assert generated == 3


def count_calls(session: ChatSession, name: str) -> list[int]:
    """A one-item list counting calls of session.`name` from now on."""
    calls, method = [0], getattr(session, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return method(*args, **kwargs)

    setattr(session, name, counted)
    return calls


def test_seeded_sampling_is_reproducible(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"))
    settings = GenerationSettings(max_new_tokens=15, temperature=1.5, top_p=1.0, top_k=0, seed=7)
    _, first = run(session, QUESTION, settings)
    session.reset()
    _, again = run(session, QUESTION, settings)
    session.reset()
    _, other = run(session, QUESTION, GenerationSettings(**{**_fields(settings), "seed": 8}))
    assert first == again
    assert first != other


def _fields(settings):
    return {name: getattr(settings, name) for name in settings.__dataclass_fields__}


def test_streamed_text_joined_equals_decoded_reply(tiny):
    # Random weights at a high temperature produce odd byte tokens: a hard case for streaming.
    settings = GenerationSettings(max_new_tokens=40, temperature=2.0, top_k=0, top_p=1.0, seed=3)
    events, tokens = run(ChatSession(tiny), QUESTION, settings)
    pieces = [e.text for e in events if isinstance(e, Token)]
    finished = events[-1]
    decoded = tiny.tokenizer.decode(tokens, skip_special_tokens=True)
    assert "".join(pieces) == finished.text == decoded
    assert not any("\ufffd" in p for p in pieces[:-1])


def test_stop_string_ends_the_reply_before_it(bundled):
    settings = GenerationSettings(greedy=True, max_new_tokens=24, stop_strings=("Paris",))
    events, _ = run(ChatSession(bundled), QUESTION, settings)
    finished = events[-1]
    assert finished.reason == "stop_string"
    assert "Paris" not in finished.text
    assert "".join(e.text for e in events if isinstance(e, Token)) == finished.text


def test_max_new_tokens_ends_with_length(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "gpt2"))
    settings = GenerationSettings(greedy=True, max_new_tokens=5, ignore_eos=True)
    events, tokens = run(session, QUESTION, settings)
    assert len(tokens) == 5 and events[-1].reason == "length"


def test_without_cache_gives_the_same_tokens(tiny):
    settings = GenerationSettings(greedy=True, max_new_tokens=12, ignore_eos=True)
    _, cached = run(ChatSession(tiny), QUESTION, settings)
    plain = GenerationSettings(greedy=True, max_new_tokens=12, ignore_eos=True, use_cache=False)
    events, uncached = run(ChatSession(tiny), QUESTION, plain)
    assert uncached == cached
    assert all(e.kv_bytes == 0 for e in events if isinstance(e, Token))


def test_timing_phases_add_up_to_the_wall_time(bundled):
    settings = GenerationSettings(greedy=True, max_new_tokens=32, ignore_eos=True)
    session = ChatSession(bundled)
    start = time.perf_counter()
    events, _ = run(session, QUESTION, settings, ProbeSettings(attention_layers=(0,)))
    wall = time.perf_counter() - start
    prefill, steps, finished = events[0], [e for e in events if isinstance(e, Token)], events[-1]
    phases = prefill.tokenize_s + sum(t.seconds for t in steps)
    assert phases == pytest.approx(wall, rel=0.05)
    assert finished.ttft_s == pytest.approx(prefill.tokenize_s + steps[0].seconds)
    assert finished.decode_s == pytest.approx(sum(t.seconds for t in steps[1:]))
    assert steps[0].seconds >= prefill.seconds
    assert finished.decode_tokens_per_s == pytest.approx(31 / finished.decode_s)


def test_a_prompt_longer_than_the_context_is_refused(tokenizer):
    loaded = make_tiny(tokenizer, "gpt2", n_positions=16)
    loaded.info = type(loaded.info)(**{**_fields(loaded.info), "max_context": 16})
    events, tokens = run(ChatSession(loaded), [Message("user", "word " * 50)])
    assert isinstance(events[0], Failed) and "holds 16" in events[0].message
    assert events[-1].reason == "context_full" and tokens == []


def test_replies_stop_at_the_context_limit(tokenizer):
    loaded = make_tiny(tokenizer, "llama")
    prompt_tokens = len(encode_chat(tokenizer, QUESTION))
    # The prompt fits (with the reserve for a reply), but 50 new tokens would not.
    loaded.info = type(loaded.info)(**{**_fields(loaded.info), "max_context": prompt_tokens + 20})
    settings = GenerationSettings(greedy=True, max_new_tokens=50, ignore_eos=True)
    events, tokens = run(ChatSession(loaded), QUESTION, settings)
    assert len(tokens) == 20 and events[-1].reason == "length"


def test_out_of_memory_ends_the_reply_and_frees_the_cache(tokenizer, monkeypatch):
    session = ChatSession(make_tiny(tokenizer, "llama"))
    real_forward, calls = session.decoder.forward, []

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(session.decoder, "forward", failing_forward)
    settings = GenerationSettings(greedy=True, max_new_tokens=10, ignore_eos=True)
    events, tokens = run(session, QUESTION, settings)
    failed, finished = events[-2], events[-1]
    assert isinstance(failed, Failed) and "out of memory" in failed.message
    assert finished.reason == "error" and finished.generated_tokens == 2 == len(tokens)
    assert session.cached_tokens == 0
    monkeypatch.setattr(session.decoder, "forward", real_forward)
    events, _ = run(session, QUESTION, settings)  # the session still works
    assert events[-1].reason == "length"


def test_an_engine_exception_becomes_a_failed_event(tokenizer, monkeypatch):
    session = ChatSession(make_tiny(tokenizer, "llama"))

    def broken(*args, **kwargs):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(session.decoder, "forward", broken)
    events, _ = run(session, QUESTION)
    assert [type(e) for e in events] == [Failed, Finished]
    assert "kernel exploded" in events[0].message and events[-1].reason == "error"


def test_old_turns_are_dropped_to_fit_and_the_prefill_says_so(tokenizer):
    loaded = make_tiny(tokenizer, "gpt2")
    loaded.info = type(loaded.info)(**{**_fields(loaded.info), "max_context": 80})
    old = [Message("user", "tell me " * 20), Message("assistant", "sure " * 20)]
    history = [Message("system", "Be brief."), *old, Message("user", "And now?")]
    settings = GenerationSettings(greedy=True, max_new_tokens=8)
    events, _ = run(ChatSession(loaded), history, settings)
    prefill = events[0]
    assert isinstance(prefill, PrefillDone) and prefill.dropped_messages == 2
    kept = [history[0], history[-1]]
    assert list(prefill.prompt_token_ids) == encode_chat(tokenizer, kept)
    stop = GenerationSettings(greedy=True, max_new_tokens=8, context_policy="stop")
    events, _ = run(ChatSession(loaded), history, stop)
    assert isinstance(events[0], Failed) and events[-1].reason == "context_full"


def test_decoding_leaves_a_core_to_the_compiled_steps_build(tokenizer):
    """While the compiled step builds in its own process (Attacher.building), each step runs
    with a thread fewer, set in the decoding thread itself; once the build ends, as before."""
    import threading
    from dataclasses import replace as replaced
    from types import SimpleNamespace

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        building = threading.Event()
        loaded = make_tiny(tokenizer, "llama")
        session = ChatSession(replaced(loaded, compiling=SimpleNamespace(building=building)))
        seen: list[int] = []
        decode = session.decode_one_token

        def noting(*args: Any) -> Any:
            seen.append(torch.get_num_threads())
            return decode(*args)

        session.decode_one_token = noting  # type: ignore[method-assign]
        settings = GenerationSettings(greedy=True, max_new_tokens=5, ignore_eos=True)
        building.set()
        list(session.generate(QUESTION, settings))
        assert seen == [1] * 4
        building.clear()
        list(session.generate(QUESTION, settings))
        assert seen[4:] == [2] * 4 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
