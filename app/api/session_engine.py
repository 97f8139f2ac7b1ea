"""The model served headless: a ChatSession in this process, as `glassbox chat` runs it.

The server's loop only wakes to write a chunk per token; the session runs on the queue's one
thread. The KV cache is kept between requests, so a conversation that grows by a turn is
prefilled from where the cache ends (usage.prompt_tokens_details.cached_tokens says how much).
"""

from __future__ import annotations

from collections.abc import Iterator

from app.api.engine_queue import Ask
from engine.events import Event
from engine.generate.session import ChatSession


class SessionEngine:
    def __init__(self, session: ChatSession) -> None:
        self.session = session

    @property
    def model_id(self) -> str:
        return self.session.info.name

    @property
    def max_context(self) -> int:
        return self.session.info.max_context

    def generate(self, ask: Ask) -> Iterator[Event]:
        return self.session.generate(ask.messages, ask.settings, ask.probes)

    def cancel(self) -> None:
        self.session.cancel()
