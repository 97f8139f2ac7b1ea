"""Completion mode: the text is fed as written, without the chat template, and continued."""

from __future__ import annotations

import pytest

from engine.events import Peaks, PrefillDone, Token
from engine.generate.session import ChatSession
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.text.prompt import encode_chat, encode_completion
from tests.models import make_tiny

FIXED = Peaks(1e11, 1e10, "float32", "cpu", "fixed for the test")  # no probe needed here
PROMPT = "Today's weather is so"
# What the seeds' example expects after "so": an adjective about the weather. llama.cpp on the
# bundled file gives " unpredictable" 7.7%, " extreme" 5.8%, " different" 5.5%.
WEATHER_ADJECTIVES = {
    "unpredictable", "extreme", "different", "nice", "warm", "hot", "cold", "beautiful",
    "bad", "harsh", "lovely", "good", "great", "pleasant", "sunny", "cool", "mild", "wet",
    "humid", "dry", "windy", "rainy", "variable", "changeable", "unusual", "strange",
}  # fmt: skip


def completion(**values) -> GenerationSettings:
    return GenerationSettings(greedy=True, completion=True, **values)


def template_ids(tokenizer) -> set[int]:
    """The ids the chat template adds around turns (e.g. <|im_start|>, <|im_end|>)."""
    chat = encode_chat(tokenizer, [Message("user", "x")])
    plain = set(tokenizer("x")["input_ids"])
    return {i for i in chat if i not in plain and tokenizer.decode([i]).startswith("<|")}


def test_the_text_is_encoded_as_written_without_the_template(tokenizer):
    messages = [Message("system", "Be kind."), Message("user", PROMPT)]
    ids = encode_completion(tokenizer, messages)
    assert ids == tokenizer(PROMPT)["input_ids"]  # the system prompt is left out
    assert tokenizer.decode(ids) == PROMPT
    markers = template_ids(tokenizer)
    assert markers and not markers & set(ids)  # the template has markers; none are here


def test_a_continued_completion_appends_and_reuses_the_cache(tokenizer):
    session = ChatSession(make_tiny(tokenizer, "llama"), peaks=FIXED)
    probes = ProbeSettings.off()
    first = [Message("user", "Once upon a time")]
    events = list(session.generate(first, completion(max_new_tokens=4, ignore_eos=True), probes))
    reply = events[-1].text
    more = [*first, Message("assistant", reply), Message("user", " there was")]
    prefill = next(iter(session.generate(more, completion(max_new_tokens=2), probes)))
    assert isinstance(prefill, PrefillDone)
    assert (
        list(prefill.prompt_token_ids)
        == tokenizer("Once upon a time" + reply + " there was")["input_ids"]
    )
    # The cache holds the first prompt and the reply but its last token (never run); the new
    # prompt reuses all of it that its own encoding shares (the seam may re-merge a token).
    generated = [e.token_id for e in events if isinstance(e, Token)]
    cached = [*events[0].prompt_token_ids, *generated[:-1]]
    shared = 0
    for old, new in zip(cached, prefill.prompt_token_ids, strict=False):
        if old != new:
            break
        shared += 1
    assert prefill.reused_tokens == shared > 0


@pytest.mark.bundled
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_bundled_model_continues_the_weather_with_an_adjective(precision, request):
    loaded = request.getfixturevalue("bundled" if precision == "exact" else "bundled_fast")
    session = ChatSession(loaded, peaks=FIXED)
    settings = completion(max_new_tokens=1)
    events = list(session.generate([Message("user", PROMPT)], settings, ProbeSettings(top_k=10)))
    prefill = events[0]
    assert isinstance(prefill, PrefillDone)
    assert list(prefill.prompt_token_ids) == loaded.tokenizer(PROMPT)["input_ids"]
    assert not template_ids(loaded.tokenizer) & set(prefill.prompt_token_ids)
    first = next(e for e in events if isinstance(e, Token))
    candidates = {c.text.strip().lower() for c in first.top_k}
    assert candidates & WEATHER_ADJECTIVES, candidates
