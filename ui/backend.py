"""What the window needs of the engine: app.client.engine_client.EngineClient has it; tests give
it fakes. Its signals arrive in the GUI thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from engine.events import ModelInfo
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings


class Backend(Protocol):
    """What the window needs of the engine (app.client.engine_client.EngineClient has it)."""

    events: Any  # Signal(list of events)
    loaded: Any  # Signal(ModelInfo)
    load_progress: Any  # Signal(str, float)
    load_failed: Any  # Signal(str)
    load_proposed: Any  # Signal(LoadRequest): before load_failed, the request placed to fit
    busy_changed: Any  # Signal(bool)
    decode_step: Any  # Signal(str): "compiled", or "eager: why"
    held_changed: Any  # Signal(bool): the reply is held by a pause, or goes on

    @property
    def info(self) -> ModelInfo | None: ...

    @property
    def busy(self) -> bool: ...

    def load(self, request: LoadRequest) -> None: ...

    def generate(
        self, messages: Sequence[Message], settings: GenerationSettings, probes: ProbeSettings
    ) -> bool: ...

    def stop(self) -> None: ...

    def pace(self, action: str, rate: float = 0.0) -> None: ...

    def reset(self) -> None: ...

    def shutdown(self) -> None: ...
