"""One generation at a time: requests wait in FIFO order, a full queue answers 429, a client
that goes away frees the model within a step, and a burst of clients gets each its own reply."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from app.api.server import Limits
from engine.settings import GenerationSettings, Message, ProbeSettings
from tests.app.api.served import HeldEngine, serving, wait_until

WAIT_S = 60.0
CLIENTS = 50
BURST_S = 300.0  # all 50 answered within this, however loaded the machine


def ask(base_url: str, model: str, text: str, max_tokens: int = 1) -> httpx.Response:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    return httpx.post(base_url + "/chat/completions", json=body, timeout=WAIT_S)


def in_thread(target, results: dict, key) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.__setitem__(key, target()), daemon=True)
    thread.start()
    return thread


def test_requests_wait_in_order_and_a_full_queue_is_429(tiny_engine):
    held = HeldEngine(tiny_engine)
    model = tiny_engine.model_id
    with serving(held, Limits(max_queue=2)) as served:
        results: dict = {}
        threads = [in_thread(lambda: ask(served.base_url, model, "first"), results, "first")]
        assert held.started.wait(WAIT_S)
        for n, name in enumerate(("second", "third"), start=1):  # one at a time: a known order
            threads.append(in_thread(lambda t=name: ask(served.base_url, model, t), results, name))
            wait_until(lambda n=n: served.queue.waiting == n, WAIT_S, f"{n} waiting")
        refused = ask(served.base_url, model, "fourth")
        assert refused.status_code == 429, refused.text
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0).completions.create(
                model=model, prompt="fifth", max_tokens=1
            )
        held.release.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert [results[k].status_code for k in ("first", "second", "third")] == [200] * 3
        assert held.calls == ["first", "second", "third"]
        assert held.clients == [f"python-httpx/{httpx.__version__}"] * 3  # who asked, to show


def test_a_dropped_stream_frees_the_model_within_a_step(tiny_engine, tiny_session):
    model = tiny_engine.model_id
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Tell a long story."}],
        "max_tokens": 200,
        "stream": True,
    }
    with serving(tiny_engine, Limits()) as served:
        tiny_session.pacer.play(20.0)  # 20 tokens a second: the reply outlasts the client
        try:
            with httpx.stream("POST", served.base_url + "/chat/completions", json=body) as answer:
                assert answer.status_code == 200
                seen = 0
                for line in answer.iter_lines():  # a few tokens in, the client goes away
                    if line.startswith("data: {") and json.loads(line[6:])["choices"]:
                        seen += 1
                    if seen == 4:
                        break
            wait_until(lambda: served.queue.finished, WAIT_S, "the dropped reply to end")
            dropped = served.queue.finished[-1]
            # 20 tokens a second: the reply stopped within steps of the client going, not at 200
            assert dropped.reason == "cancelled" and dropped.generated_tokens < seen + 40
        finally:
            tiny_session.pacer.resume()
        assert ask(served.base_url, model, "next").status_code == 200
        assert served.queue.finished[-1].reason in ("length", "eos"), [
            (f.reason, f.prompt_tokens, f.generated_tokens) for f in served.queue.finished
        ]


def test_a_burst_of_clients_each_get_their_own_reply_or_429(tiny_engine, tiny_session):
    """50 clients at once: each is answered with its own reply or refused with 429 at once;
    none is lost, none runs twice, none gets another's reply."""
    prompts = [f"Say the number {i}." for i in range(CLIENTS)]
    settings = GenerationSettings(max_new_tokens=2, greedy=True, top_k=0, top_p=1.0)
    expected = {}
    for prompt in prompts:  # the session's own reply to each, one by one
        events = list(
            tiny_session.generate([Message("user", prompt)], settings, ProbeSettings.off())
        )
        expected[prompt] = events[-1].text
    recorded = HeldEngine(tiny_engine)  # released from the start: it only records the calls
    recorded.release.set()
    results: dict = {}
    with serving(recorded, Limits(max_queue=8)) as served:
        threads = [
            in_thread(lambda p=p: ask(served.base_url, tiny_engine.model_id, p, 2), results, p)
            for p in prompts
        ]
        wait_until(lambda: not any(t.is_alive() for t in threads), BURST_S, "every client's answer")
        assert served.queue.waiting == 0
    assert sorted(results) == sorted(prompts)  # every client was answered
    statuses = [results[p].status_code for p in prompts]
    assert set(statuses) <= {200, 429}, statuses
    answered = [p for p in prompts if results[p].status_code == 200]
    assert len(answered) >= 9  # the running one and a full queue at least
    for prompt in answered:
        assert results[prompt].json()["choices"][0]["message"]["content"] == expected[prompt]
    for prompt in set(prompts) - set(answered):
        assert results[prompt].headers["retry-after"] == "1"
        assert results[prompt].json()["error"]["code"] == "queue_full"
    assert sorted(recorded.calls) == sorted(answered)  # each admitted one ran once, no other
