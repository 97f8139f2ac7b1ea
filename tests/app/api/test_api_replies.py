"""The official `openai` client against the real server: replies, streams, log-probabilities
and usage equal what the engine's session says for the same messages and settings."""

from __future__ import annotations

import math
import threading

import httpx
import openai
import pytest

from engine.events import Finished, PrefillDone, Token
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.app.api.served import wait_until

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]
TOKENS = 12
WAIT_S = 60.0  # a loaded CI machine: conditions are awaited, never timed


def client(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, **kwargs)


def engine_reply(session, messages, completion=False, top_k=0, tokens=TOKENS, text_per_token=False):
    """The session's own greedy reply: its tokens, its prefill and its ending."""
    settings = GenerationSettings(
        max_new_tokens=tokens,
        greedy=True,
        top_k=0,
        top_p=1.0,
        completion=completion,
        text_per_token=text_per_token,
    )
    probes = ProbeSettings(top_k=top_k, kv_per_layer=False)
    events = list(session.generate([Message(**m) for m in messages], settings, probes))
    tokens_ = [e for e in events if isinstance(e, Token)]
    prefill = next(e for e in events if isinstance(e, PrefillDone))
    return tokens_, prefill, events[-1]


def test_models_lists_the_served_model(server, tiny_engine):
    models = client(server).models.list()
    assert [m.id for m in models.data] == [tiny_engine.model_id]
    assert client(server).models.retrieve(tiny_engine.model_id).id == tiny_engine.model_id


def test_chat_reply_is_the_sessions_greedy_reply(server, tiny_session, tiny_engine):
    tokens, prefill, finished = engine_reply(tiny_session, MESSAGES)
    tiny_session.reset()  # the server's request then prefills from nothing, as the engine did
    reply = client(server).chat.completions.create(
        model=tiny_engine.model_id, messages=MESSAGES, temperature=0, max_tokens=TOKENS
    )
    assert isinstance(finished, Finished)
    assert reply.choices[0].message.content == finished.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if finished.reason == "length" else "stop")
    assert reply.usage.prompt_tokens == prefill.prompt_tokens
    assert reply.usage.completion_tokens == len(tokens)
    assert reply.usage.total_tokens == prefill.prompt_tokens + len(tokens)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    timings = reply.usage.model_extra["timings"]
    assert timings["ttft_s"] > 0 and timings["decode_tokens_per_s"] > 0


def test_the_same_prompt_again_reuses_the_cache(server, tiny_engine):
    api = client(server)
    ask = dict(model=tiny_engine.model_id, messages=MESSAGES, temperature=0, max_tokens=2)
    api.chat.completions.create(**ask)
    again = api.chat.completions.create(**ask)
    # Everything but the last prompt token, which runs again for the next token's logits.
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_streamed_chat_joins_to_the_whole_reply(server, tiny_session, tiny_engine):
    _tokens, prefill, finished = engine_reply(tiny_session, MESSAGES)
    stream = client(server).chat.completions.create(
        model=tiny_engine.model_id,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == finished.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    assert chunks[-1].usage.prompt_tokens == prefill.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_completion_is_the_sessions_completion_mode(server, tiny_session, tiny_engine):
    prompt = [{"role": "user", "content": "Once upon a time"}]
    _tokens, _prefill, finished = engine_reply(tiny_session, prompt, completion=True)
    api = client(server)
    reply = api.completions.create(
        model=tiny_engine.model_id, prompt="Once upon a time", temperature=0, max_tokens=TOKENS
    )
    assert reply.choices[0].text == finished.text
    streamed = api.completions.create(
        model=tiny_engine.model_id,
        prompt="Once upon a time",
        temperature=0,
        max_tokens=TOKENS,
        stream=True,
    )
    assert "".join(c.choices[0].text for c in streamed) == finished.text


def test_top_logprobs_are_the_engines_probe(server, tiny_session, tiny_engine):
    tokens, _prefill, _finished = engine_reply(tiny_session, MESSAGES, top_k=20, tokens=4)
    reply = client(server).chat.completions.create(
        model=tiny_engine.model_id,
        messages=MESSAGES,
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=5,
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == len(tokens) == 4
    for entry, token in zip(entries, tokens, strict=True):
        assert entry.token == token.piece
        assert [t.token for t in entry.top_logprobs] == [c.text for c in token.top_k[:5]]
        expected = [math.log(c.prob) for c in token.top_k[:5]]
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(expected, abs=1e-5)
        # greedy: the chosen token is the likeliest, so its log-probability is the first
        assert entry.logprob == pytest.approx(expected[0], abs=1e-5)
        assert entry.bytes == list(token.piece.encode())


def test_completion_logprobs_in_the_legacy_shape(server, tiny_session, tiny_engine):
    prompt = [{"role": "user", "content": "The sky is"}]
    tokens, _p, _f = engine_reply(tiny_session, prompt, completion=True, top_k=20, tokens=3)
    reply = client(server).completions.create(
        model=tiny_engine.model_id, prompt="The sky is", temperature=0, max_tokens=3, logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs.tokens == [t.piece for t in tokens]
    assert logprobs.token_logprobs == pytest.approx([math.log(t.top_k[0].prob) for t in tokens])
    assert [list(d) for d in logprobs.top_logprobs] == [
        [c.text for c in t.top_k[:2]] for t in tokens
    ]
    # offsets into the prompt and the reply, as OpenAI counts them without `echo` too; the
    # API streams text per token
    apart, _p, _f = engine_reply(
        tiny_session, prompt, completion=True, top_k=20, tokens=3, text_per_token=True
    )
    starts = [len("The sky is") + len("".join(t.text for t in apart[:i])) for i in range(3)]
    assert logprobs.text_offset == starts


def test_a_seed_makes_a_sampled_reply_repeat(server, tiny_engine):
    ask = dict(model=tiny_engine.model_id, messages=MESSAGES, temperature=1.0, max_tokens=6, seed=7)
    api = client(server)
    first = api.chat.completions.create(**ask).choices[0].message.content
    assert api.chat.completions.create(**ask).choices[0].message.content == first


def test_health_is_plain_json(server):
    answer = httpx.get(server.base_url.removesuffix("/v1") + "/health")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"


def test_a_stop_string_cuts_the_reply_where_the_session_does(server, tiny_session, tiny_engine):
    _tokens, _prefill, finished = engine_reply(tiny_session, MESSAGES)
    stop = finished.text.strip().split()[1]  # a word from the middle of the greedy reply
    reply = client(server).chat.completions.create(
        model=tiny_engine.model_id, messages=MESSAGES, temperature=0, max_tokens=TOKENS, stop=stop
    )
    assert reply.choices[0].message.content == finished.text[: finished.text.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_developer_turns_and_text_parts_are_the_same_messages(server, tiny_engine):
    api = client(server)
    plain = api.chat.completions.create(
        model=tiny_engine.model_id, messages=MESSAGES, temperature=0, max_tokens=4
    )
    parts = api.chat.completions.create(
        model=tiny_engine.model_id,
        messages=[
            {"role": "developer", "content": "You are terse."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Name three "},
                    {"type": "text", "text": "colours."},
                ],
            },
        ],
        temperature=0,
        max_tokens=4,
    )
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_the_first_word_streams_with_its_token(server, tiny_session, tiny_engine):
    """Each token's text goes out as it is generated: with the reply held after the token that
    brings its first text, that text has reached the client before the next token exists."""
    tokens, _prefill, finished = engine_reply(tiny_session, MESSAGES, text_per_token=True)
    first = next(i for i, token in enumerate(tokens) if token.text)
    received: list[str] = []

    def read() -> None:
        stream = client(server).chat.completions.create(
            model=tiny_engine.model_id,
            messages=MESSAGES,
            temperature=0,
            max_tokens=TOKENS,
            stream=True,
        )
        received.extend(c.choices[0].delta.content or "" for c in stream if c.choices)

    pacer = tiny_session.pacer
    pacer.pause()
    reader = threading.Thread(target=read, daemon=True)
    try:
        reader.start()
        for _ in range(first + 1):  # one token at a time, up to the first with text
            wait_until(lambda: pacer.pace.waiting, WAIT_S, "the reply to be held")
            pacer.step()
        wait_until(lambda: pacer.pace.waiting, WAIT_S, "the reply to be held again")
        wait_until(lambda: any(received), WAIT_S, "the first text to reach the client")
        assert pacer.pace.waiting and pacer.pace.granted == 0  # no further token was made
        assert next(text for text in received if text) == tokens[first].text
    finally:
        pacer.resume()
        reader.join(WAIT_S)
    assert not reader.is_alive() and "".join(received) == finished.text
