"""Fixtures for the API's tests: a tiny random llama behind the real server (fast), and the
session that serves it, to compare the server's replies with the engine's own."""

from __future__ import annotations

import pytest

from app.api.server import Limits
from app.api.session_engine import SessionEngine
from engine.generate.session import ChatSession
from tests.app.api.served import serving
from tests.models import make_tiny

KEY = "test-key-0123456789"
TINY_CONTEXT = 256  # small, so a prompt beyond it is cheap to build


@pytest.fixture(scope="module")
def tiny_session(tokenizer) -> ChatSession:
    return ChatSession(make_tiny(tokenizer, "llama", max_position_embeddings=TINY_CONTEXT))


@pytest.fixture(scope="module")
def tiny_engine(tiny_session) -> SessionEngine:
    return SessionEngine(tiny_session)


@pytest.fixture(scope="module")
def server(tiny_engine):
    """The server over the tiny model, no key (loopback), small limits."""
    with serving(tiny_engine, Limits(max_tokens=512, max_queue=4, max_body_bytes=64_000)) as s:
        yield s


@pytest.fixture(scope="module")
def keyed_server(tiny_engine):
    with serving(tiny_engine, Limits(api_key=KEY)) as served:
        yield served
