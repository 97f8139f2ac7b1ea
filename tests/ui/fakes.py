"""The fake model of the window's tests: app.bench.synthetic's session with a short reply.

It honours the session contract (PrefillDone, one Token per piece, Finished, Failed before it
on error); `cancel()` from any thread ends the reply within one step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.bench.synthetic import SyntheticSession, model_info
from engine.device_map import Proposal
from engine.events import ModelInfo
from engine.settings import LoadRequest

REPLY = ("Hello", ",", " this", " is", " a", " **fake**", " reply", ".")
STEP_S = 0.01  # each decode step: 100 tokens/s


def fake_info(name: str = "fake-135M", device: str = "cpu", dtype: str = "float32") -> ModelInfo:
    """A two-layer model's shapes (small attention rows), named as the tests load it."""
    return model_info(
        name=name, source="folder", device=device, dtype=dtype,
        layers=2, heads=4, kv_heads=2, head_dim=16, max_context=2048,
    )  # fmt: skip


def fake_session(
    info: ModelInfo | None = None,
    pieces: Sequence[str] = REPLY,
    delay: float = 0.0,
    gate: threading.Semaphore | None = None,
) -> SyntheticSession:
    """Yields `pieces` as tokens, `delay` seconds apart (or one per `gate` release)."""
    return SyntheticSession(info or fake_info(), pieces, delay=delay, gate=gate, step_s=STEP_S)


class ModelLoadError(Exception):
    """Named like engine.load.loader's error, whose message the worker shows as it is."""

    def __init__(self, message: str, fits_as: Proposal | None = None) -> None:
        super().__init__(message)
        self.fits_as = fits_as


# What loading "too-big" without a placement says, and the placement it proposes.
TOO_BIG = Proposal(
    "too-big needs 9.0 GB on cpu but only 4.0 GB is free: 5.0 GB missing. It would fit as"
    " --device-map auto --max-memory cpu=2048MiB (about 6.9 GB of weights read from disk"
    " on every token).",
    "auto",
    "cpu=2048MiB",
)


@dataclass
class FakeLoaded:
    info: ModelInfo
    pieces: Sequence[str] = REPLY
    delay: float = 0.0


@dataclass
class FakeBackend:
    """A loader and session factory for an engine server, with a session per model name.

    Loading the spec "broken" fails; "too-big" fails with a proposal (TOO_BIG) unless placed;
    any other spec loads a fake session.
    """

    delay: float = 0.0
    gate: threading.Semaphore | None = None
    pieces: Sequence[str] = REPLY
    sessions: list[SyntheticSession] = field(default_factory=list)
    requests: list[LoadRequest] = field(default_factory=list)

    def load(self, request: LoadRequest, progress) -> FakeLoaded:
        self.requests.append(request)
        progress("Finding the model", 0.1)
        if request.spec == "broken":
            raise ModelLoadError(f"No model at {request.spec}: that file or folder does not exist.")
        if request.spec == "too-big" and not request.placed:
            raise ModelLoadError(TOO_BIG.line, TOO_BIG)
        progress("Ready", 1.0)
        dtype = "float32" if request.dtype == "auto" else request.dtype
        device = "cpu" if request.device == "auto" else request.device
        return FakeLoaded(fake_info(name=request.spec, device=device, dtype=dtype))

    def make_session(self, loaded: FakeLoaded) -> SyntheticSession:
        session = fake_session(loaded.info, self.pieces, self.delay, self.gate)
        self.sessions.append(session)
        return session

    @property
    def session(self) -> SyntheticSession:
        return self.sessions[-1]


# -- in the engine process -------------------------------------------------------------------
# The engine child imports these by name (app.server.engine_spec.EngineSpec). Options travel in
# LoadRequest.extra: "delay" seconds per token and "tokens" (a reply of that many " wN").


def process_loader(request: LoadRequest, progress) -> FakeLoaded:
    loaded = FakeBackend().load(request, progress)
    tokens = int(request.extra.get("tokens", 0))
    pieces = tuple(f" w{i}" for i in range(tokens)) if tokens else REPLY
    return FakeLoaded(loaded.info, pieces, float(request.extra.get("delay", 0.0)))


def process_session(loaded: FakeLoaded) -> SyntheticSession:
    return fake_session(loaded.info, loaded.pieces, loaded.delay)
