"""The HTTP side: FastAPI routes in OpenAI's shape over an EngineQueue.

    app = create_app(engine, Limits(api_key="..."))
    uvicorn.run(app, host="127.0.0.1", port=8080)

Every request is checked in the same order: the key (401), the body's size (413), its JSON and
fields (400), the model (404), then it waits for the model (429 when the queue is full) and
the prompt is fitted to the context (400 context_length_exceeded). Nothing in a request names
a file or loads a model: the model is the one the server was started with.
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from app.api import errors
from app.api.engine_queue import Ask, Engine, EngineQueue, Job
from app.api.errors import ApiError
from app.api.replies import Reply
from app.api.requests import COMPLETION_DEFAULT_TOKENS, ChatRequest, CompletionRequest
from app.options import SERVE_LIMITS
from engine.events import Failed, Finished, Token

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask and how many may wait. `api_key` None: no key asked."""

    api_key: str | None = None
    max_body_bytes: int = SERVE_LIMITS["max_body_bytes"]
    max_tokens: int = SERVE_LIMITS["max_tokens"]  # per reply; also a chat request's default
    max_queue: int = SERVE_LIMITS["max_queue"]  # requests waiting behind the running one


def create_app(engine: Engine, limits: Limits) -> FastAPI:
    queue = EngineQueue(engine, limits.max_queue)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        queue.close()  # on shutdown: the running reply stopped, the engine's thread joined

    app = FastAPI(
        title="Glassbox", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan
    )
    app.state.queue = queue
    app.add_exception_handler(ApiError, errors.on_api_error)
    app.add_exception_handler(HTTPException, errors.on_http_error)
    app.add_exception_handler(RequestValidationError, errors.on_validation_error)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "waiting": queue.waiting}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_key(request, limits)
        return {"object": "list", "data": [model_card(engine)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict[str, Any]:
        check_key(request, limits)
        check_model(model_id, engine)
        return model_card(engine)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> JSONResponse | StreamingResponse:
        body = await read_body(request, limits, ChatRequest)
        assert isinstance(body, ChatRequest)
        return await answer(request, queue, limits, body, "chat")

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> JSONResponse | StreamingResponse:
        body = await read_body(request, limits, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        return await answer(request, queue, limits, body, "text")

    return app


def model_card(engine: Engine) -> dict[str, Any]:
    return {
        "id": engine.model_id,
        "object": "model",
        "created": 0,
        "owned_by": "glassbox",
        "context_length": engine.max_context,
    }


# -- checks, in order ------------------------------------------------------------------------


def check_key(request: Request, limits: Limits) -> None:
    """`Authorization: Bearer <key>`, compared in constant time."""
    if limits.api_key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(
        token.strip().encode(), limits.api_key.encode()
    ):
        raise ApiError(
            401,
            "A valid API key is needed: send it as `Authorization: Bearer <key>`.",
            code="invalid_api_key",
        )


async def read_body(
    request: Request, limits: Limits, schema: type[ChatRequest] | type[CompletionRequest]
) -> ChatRequest | CompletionRequest:
    check_key(request, limits)
    raw = await bounded_body(request, limits.max_body_bytes)
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ApiError(400, f"The body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
    try:
        return schema.model_validate(data)
    except ValidationError as error:
        raise errors.invalid(error) from None


async def bounded_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it passes `limit` bytes (declared or as it arrives)."""
    too_large = ApiError(413, f"The body is over {limit} bytes.", code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def check_model(name: str, engine: Engine) -> None:
    if name != engine.model_id:
        raise ApiError(
            404,
            f"The model {name!r} is not served here; this server serves {engine.model_id!r}.",
            param="model",
            code="model_not_found",
        )


def reply_tokens(body: ChatRequest | CompletionRequest, limits: Limits, default: int) -> int:
    asked = body.asked_tokens()
    if asked is not None and asked > limits.max_tokens:
        param = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else None
        raise ApiError(
            400,
            f"At most {limits.max_tokens} tokens per reply on this server (asked {asked}).",
            param=param or "max_tokens",
            code="invalid_value",
        )
    return min(default, limits.max_tokens) if asked is None else asked


# -- the reply -------------------------------------------------------------------------------


async def answer(
    request: Request,
    queue: EngineQueue,
    limits: Limits,
    body: ChatRequest | CompletionRequest,
    kind: str,
) -> JSONResponse | StreamingResponse:
    check_model(body.model, queue.engine)
    chat = isinstance(body, ChatRequest)
    tokens = reply_tokens(body, limits, limits.max_tokens if chat else COMPLETION_DEFAULT_TOKENS)
    settings = body.settings(tokens, completion=not chat)
    top = _top(body)
    started = time.perf_counter()
    agent = request.headers.get("user-agent", "")
    ask = Ask(tuple(body.engine_messages()), settings, body.probes(), agent)
    job = await queue.start(ask, lambda: disconnected(request))
    start = 0 if isinstance(body, ChatRequest) else len(body.prompt_text)
    reply = Reply("chat" if chat else "text", queue.engine.model_id, top, text_start=start)
    log.info(
        "%s reply for %r after %.3f s in the queue", kind, agent, time.perf_counter() - started
    )
    if body.stream:
        return StreamingResponse(
            stream(job, reply, body.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return JSONResponse(await whole(job, reply))


def _top(body: ChatRequest | CompletionRequest) -> int | None:
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


async def disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by then: only a disconnect is left)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def whole(job: Job, reply: Reply) -> dict[str, Any]:
    """The reply once its generation has ended (read to its end, so the job is closed)."""
    failure, finished = Failed("The engine ended without finishing.", "EngineError"), None
    async for event in job.events():
        if isinstance(event, Token):
            reply.add(event)
        elif isinstance(event, Failed):
            failure = event
        elif isinstance(event, Finished):
            finished = event
    if finished is None or finished.reason == "error":
        raise ApiError(500, failure.message, code=failure.error_type)
    return reply.whole(finished)


async def stream(job: Job, reply: Reply, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per token with text (or log-probabilities), the finish
    reason, the usage if asked, then [DONE]. A failure mid-reply is an `error` event."""
    first = reply.first_chunk()
    if first is not None:
        yield sse(first)
    async for event in job.events():
        if isinstance(event, Token):
            reply.add(event)
            chunk = reply.token_chunk(event)
            if chunk is not None:
                yield sse(chunk)
        elif isinstance(event, Failed):
            yield sse(errors.error_body(500, event.message, code=event.error_type))
        elif isinstance(event, Finished) and event.reason != "error":
            yield sse(reply.last_chunk(event))
            if include_usage:
                yield sse(reply.usage_chunk(event))
    yield "data: [DONE]\n\n"


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
