"""A stand-in for engine.session.ChatSession that yields real events without a model.

It honours the session contract: PrefillDone, then one Token per piece, then Finished (with
Failed before it on error); `cancel()` from any thread ends the reply within one step.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from engine.events import Event, Finished, ModelInfo, PrefillDone, Token
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings

REPLY = ("Hello", ",", " this", " is", " a", " **fake**", " reply", ".")


def fake_info(name: str = "fake-135M", device: str = "cpu", dtype: str = "float32") -> ModelInfo:
    return ModelInfo(
        name=name,
        source="folder",
        architecture="LlamaForCausalLM",
        device=device,
        dtype=dtype,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        parameters=134_515_008,
        max_context=2048,
        vocab_size=49152,
        bytes_per_value=4,
    )


class ModelLoadError(Exception):
    """Named like engine.loader's error, whose message the worker shows as it is."""


@dataclass
class FakeLoaded:
    info: ModelInfo
    pieces: Sequence[str] = REPLY
    delay: float = 0.0


class FakeSession:
    """Yields `pieces` as tokens, `delay` seconds apart (or one per `gate` release)."""

    def __init__(
        self,
        info: ModelInfo | None = None,
        pieces: Sequence[str] = REPLY,
        delay: float = 0.0,
        gate: threading.Semaphore | None = None,
        raise_after: int | None = None,
    ) -> None:
        self.info = info or fake_info()
        self.pieces = tuple(pieces)
        self.delay = delay
        self.gate = gate
        self.raise_after = raise_after
        self.calls: list[tuple[Message, ...]] = []
        self.resets = 0
        self.started = threading.Event()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    def reset(self) -> None:
        self.resets += 1

    def count_tokens(self, messages: Sequence[Message]) -> int:
        return sum(len(m.content.split()) + 3 for m in messages)

    def generate(
        self,
        messages: Sequence[Message],
        settings: GenerationSettings | None = None,
        probes: ProbeSettings | None = None,
    ) -> Iterator[Event]:
        settings = settings or GenerationSettings()
        self._cancel.clear()  # as the real session does: a cancel before the start is lost
        self.calls.append(tuple(messages))
        self.started.set()
        started = time.perf_counter()
        prompt = self.count_tokens(messages)
        yield PrefillDone(
            prompt_tokens=prompt,
            reused_tokens=0,
            processed_tokens=prompt,
            tokenize_s=0.001,
            seconds=0.01,
            kv_bytes=prompt * 512,
            kv_bytes_per_layer=(prompt * 256, prompt * 256),
            prompt_token_ids=tuple(range(prompt)),
            token_texts=tuple(f"t{i}" for i in range(prompt)),
        )
        text: list[str] = []
        reason = "length"
        for index, piece in enumerate(self.pieces[: settings.max_new_tokens]):
            if self._wait():
                reason = "cancelled"
                break
            if self.raise_after is not None and index >= self.raise_after:
                raise RuntimeError("the fake model broke")
            text.append(piece)
            yield Token(
                index=index,
                token_id=100 + index,
                text=piece,
                piece=piece,
                seconds=0.02 if index == 0 else 0.01,
                kv_bytes=(prompt + index + 1) * 512,
                kv_bytes_per_layer=((prompt + index + 1) * 256,) * 2,
            )
        else:
            reason = "eos"
        generated = len(text)
        yield Finished(
            reason=reason,  # type: ignore[arg-type]
            text="".join(text),
            prompt_tokens=prompt,
            reused_tokens=0,
            generated_tokens=generated,
            tokenize_s=0.001,
            prefill_s=0.01,
            ttft_s=0.25,
            decode_s=0.01 * max(generated - 1, 0) or 0.0,
            total_s=time.perf_counter() - started,
        )

    def _wait(self) -> bool:
        """Wait for the next step; True if cancelled meanwhile."""
        if self.gate is not None:
            while not self.gate.acquire(timeout=0.01):
                if self._cancel.is_set():
                    return True
        elif self.delay:
            self._cancel.wait(self.delay)
        return self._cancel.is_set()


@dataclass
class FakeBackend:
    """A loader and session factory for GenerationWorker, with a session per model name.

    Loading the spec "broken" fails; any other spec loads a FakeSession.
    """

    delay: float = 0.0
    gate: threading.Semaphore | None = None
    pieces: Sequence[str] = REPLY
    sessions: list[FakeSession] = field(default_factory=list)
    requests: list[LoadRequest] = field(default_factory=list)

    def load(self, request: LoadRequest, progress) -> FakeLoaded:
        self.requests.append(request)
        progress("Finding the model", 0.1)
        if request.spec == "broken":
            raise ModelLoadError(f"No model at {request.spec}: that file or folder does not exist.")
        progress("Ready", 1.0)
        dtype = "float32" if request.dtype == "auto" else request.dtype
        device = "cpu" if request.device == "auto" else request.device
        return FakeLoaded(fake_info(name=request.spec, device=device, dtype=dtype))

    def make_session(self, loaded: FakeLoaded) -> FakeSession:
        session = FakeSession(loaded.info, self.pieces, self.delay, self.gate)
        self.sessions.append(session)
        return session

    @property
    def session(self) -> FakeSession:
        return self.sessions[-1]


# -- in the engine process -------------------------------------------------------------------
# The engine child imports these by name (app.engine_process.EngineSpec). Options travel in
# LoadRequest.extra: "delay" seconds per token and "tokens" (a reply of that many " wN").


def process_loader(request: LoadRequest, progress) -> FakeLoaded:
    loaded = FakeBackend().load(request, progress)
    tokens = int(request.extra.get("tokens", 0))
    pieces = tuple(f" w{i}" for i in range(tokens)) if tokens else REPLY
    return FakeLoaded(loaded.info, pieces, float(request.extra.get("delay", 0.0)))


def process_session(loaded: FakeLoaded) -> FakeSession:
    return FakeSession(loaded.info, loaded.pieces, loaded.delay)
