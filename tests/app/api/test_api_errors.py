"""Every refusal in OpenAI's error shape with its status; a bounded burst of malformed and
hostile requests leaves the server up and answering."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from pydantic import ValidationError

from app.api.errors import invalid
from app.api.requests import ChatRequest
from app.api.server import Limits
from engine.events import Failed, Tally
from tests.app.api.conftest import KEY, TINY_CONTEXT
from tests.app.api.served import serving

LIMIT_BODY = 64_000  # the `server` fixture's


def post(
    server, path: str, body: object = None, raw: bytes | None = None, **headers
) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(
        server.base_url + path,
        content=content,
        headers={"content-type": "application/json", **headers},
        timeout=60,
    )


def error_of(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def chat(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_unknown_model_is_404(server):
    error = error_of(post(server, "/chat/completions", chat("gpt-4o")), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).models.retrieve("nope")


def test_invalid_json_and_fields_are_400(server, tiny_engine):
    model = tiny_engine.model_id
    assert error_of(post(server, "/chat/completions", raw=b"{not json"), 400)["code"] == (
        "invalid_json"
    )
    error = error_of(post(server, "/chat/completions", chat(model, max_tokens="5")), 400)
    assert error["param"] == "max_tokens"
    error = error_of(post(server, "/chat/completions", chat(model, n=2)), 400)
    assert error["param"] == "n"
    with pytest.raises(openai.BadRequestError):
        openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0).chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], temperature=5
        )


def test_a_prompt_beyond_the_context_is_context_length_exceeded(server, tiny_engine):
    long = " ".join(["word"] * (TINY_CONTEXT * 2))
    body = {"model": tiny_engine.model_id, "messages": [{"role": "user", "content": long}]}
    error = error_of(post(server, "/chat/completions", body | {"max_tokens": 4}), 400)
    assert error["code"] == "context_length_exceeded"
    streamed = post(server, "/chat/completions", body | {"max_tokens": 4, "stream": True})
    assert error_of(streamed, 400)["code"] == "context_length_exceeded"
    text = {"model": tiny_engine.model_id, "prompt": long, "max_tokens": 4}
    assert error_of(post(server, "/completions", text), 400)["code"] == "context_length_exceeded"
    # and the model is free again
    assert post(server, "/chat/completions", chat(tiny_engine.model_id, max_tokens=1)).is_success


def test_a_body_too_large_is_413(server, tiny_engine):
    body = chat(tiny_engine.model_id, padding="x" * LIMIT_BODY)
    assert error_of(post(server, "/chat/completions", body), 413)["code"] == "request_too_large"


def test_a_chunked_body_is_cut_off_at_the_limit(server, tiny_engine):
    """No Content-Length to refuse up front: the body is counted as it arrives."""

    def pieces():
        yield json.dumps(chat(tiny_engine.model_id))[:-1].encode() + b', "pad": "'
        for _ in range(LIMIT_BODY // 1000 + 2):  # bounded: just past the limit
            yield b"x" * 1000
        yield b'"}'

    answer = httpx.post(server.base_url + "/chat/completions", content=pieces(), timeout=60)
    assert "content-length" not in answer.request.headers
    assert error_of(answer, 413)["code"] == "request_too_large"


def test_a_reply_longer_than_the_limit_is_400(server, tiny_engine):
    error = error_of(
        post(server, "/chat/completions", chat(tiny_engine.model_id, max_tokens=513)), 400
    )
    assert error["param"] == "max_tokens" and "512" in error["message"]


def test_a_missing_or_wrong_key_is_401(keyed_server, tiny_engine):
    body = chat(tiny_engine.model_id, max_tokens=1)
    assert error_of(post(keyed_server, "/chat/completions", body), 401)["code"] == "invalid_api_key"
    wrong = post(keyed_server, "/chat/completions", body, authorization="Bearer wrong")
    error_of(wrong, 401)
    assert httpx.get(keyed_server.base_url + "/models").status_code == 401
    right = post(keyed_server, "/chat/completions", body, authorization=f"Bearer {KEY}")
    assert right.status_code == 200
    api = openai.OpenAI(base_url=keyed_server.base_url, api_key=KEY, max_retries=0)
    assert api.models.list().data[0].id == tiny_engine.model_id
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed_server.base_url, api_key="bad", max_retries=0).models.list()


def hostile_requests(model: str) -> list[tuple[str, bytes, int]]:
    """(path, body, expected status): each kind of bad request a client or attacker may send."""
    good = chat(model)

    def body(data: object) -> bytes:
        return json.dumps(data).encode()

    return [
        ("/chat/completions", b"{", 400),
        ("/chat/completions", b"\xff\xfe\x00", 400),
        ("/chat/completions", b"[]", 400),
        ("/chat/completions", b"null", 400),
        ("/chat/completions", body({"model": model}), 400),
        ("/chat/completions", body(good | {"messages": []}), 400),
        ("/chat/completions", body(good | {"messages": "hi"}), 400),
        ("/chat/completions", body(good | {"messages": [{"role": "root", "content": "x"}]}), 400),
        ("/chat/completions", body(good | {"max_tokens": -1}), 400),
        ("/chat/completions", body(good | {"max_tokens": 10**12}), 400),
        ("/chat/completions", body(good | {"max_tokens": 1.5}), 400),
        ("/chat/completions", body(good | {"temperature": "hot"}), 400),
        ("/chat/completions", body(good | {"top_p": 0}), 400),
        ("/chat/completions", body(good | {"top_logprobs": 99, "logprobs": True}), 400),
        ("/chat/completions", body(good | {"stop": ["a"] * 50}), 400),
        ("/chat/completions", body(good | {"stream": "yes"}), 400),
        ("/chat/completions", body(good | {"unknown": 1, "model": 3}), 400),
        ("/chat/completions", body(good | {"model": "../../etc/passwd"}), 404),
        ("/chat/completions", body(good | {"pad": "x" * (LIMIT_BODY + 1)}), 413),
        ("/completions", body({"model": model, "prompt": ""}), 400),
        ("/completions", body({"model": model, "prompt": ["a", "b"]}), 400),
        ("/completions", body({"model": model, "prompt": "a", "echo": True}), 400),
        ("/completions", body({"model": model, "prompt": "a", "logprobs": 9}), 400),
        ("/completions/../models", body(good), 405),  # a client resolves it to /models
        ("/nowhere", body(good), 404),
    ]


def test_a_burst_of_hostile_requests_is_answered_and_the_server_stays_up(server, tiny_engine):
    cases = hostile_requests(tiny_engine.model_id)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for i in range(1000):  # every kind forty times
            path, content, status = cases[i % len(cases)]
            answer = http.post(path, content=content, headers={"content-type": "application/json"})
            assert answer.status_code == status, (path, content[:80], answer.text)
            assert answer.json()["error"]["message"]
        assert http.get("/models").status_code == 200
    reply = post(server, "/chat/completions", chat(tiny_engine.model_id, max_tokens=2))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1


class FailingEngine:
    """An engine whose every reply fails as the session reports a failure: Failed, then
    Finished("error")."""

    model_id = "broken"
    max_context = 100

    def generate(self, ask):
        yield Failed("The device ran out of memory.", "OutOfMemoryError")
        yield Tally(started=time.perf_counter()).finished("error", "")

    def cancel(self) -> None:
        pass


def test_an_engine_failure_is_500_whole_or_an_error_event_streamed():
    with serving(FailingEngine(), Limits()) as served:
        error = error_of(post(served, "/chat/completions", chat("broken")), 500)
        assert error["code"] == "OutOfMemoryError" and "memory" in error["message"]
        api = openai.OpenAI(base_url=served.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.APIError, match="memory"):
            for _chunk in api.chat.completions.create(
                model="broken", messages=[{"role": "user", "content": "hi"}], stream=True
            ):
                pass
        assert httpx.get(served.base_url + "/models").status_code == 200


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4 items"),
        ({"stop": 5}, "stop", "a valid string or a valid list"),
        ({"temperature": "hot"}, "temperature", "a valid number"),
        ({"max_tokens": "5"}, "max_tokens", "a valid integer"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content.0.type",
            "'text'",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "a valid list"),
        ({"top_logprobs": 2}, "top_logprobs", "top_logprobs: only allowed when logprobs is true"),
    ],
)
def test_a_field_of_several_types_is_refused_for_the_type_sent(fields, param, says):
    """`stop` takes a string or a list: a list of five is refused as a list (too long), not as
    a string, and the param names the field, not pydantic's tag for a type."""
    with pytest.raises(ValidationError) as refused:
        ChatRequest.model_validate(chat("m") | fields)
    error = invalid(refused.value)
    assert error.param == param and error.message.startswith(f"{param}: ")
    assert says in error.message, error.message
