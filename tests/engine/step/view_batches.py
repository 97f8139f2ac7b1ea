"""A fast model's reply with its watched layers weighed step by step, and the same reply with
them weighed by its batches of steps (engine/generate/view_batch.py): the two compared."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.events import Token
from engine.generate import view_batch
from engine.generate.session import ChatSession
from engine.load.loader import LoadedModel
from engine.settings import GenerationSettings, Message, ProbeSettings


def reply(loaded: LoadedModel, settings: GenerationSettings, probes: ProbeSettings,
          batched: bool, monkeypatch: Any) -> list[Token]:  # fmt: skip
    """The reply's tokens: `batched`, each batch weighing its steps' queries at once;
    otherwise each step weighs its queries in its pass and goes out alone."""
    session = ChatSession(loaded)
    if not batched:
        session._weigh = None
    monkeypatch.setattr(view_batch, "FLUSH_S", 60.0 if batched else 0.0)
    events = session.generate([Message("user", "Hi")], settings, probes)
    return [e for e in events if isinstance(e, Token)]


def assert_batches_weigh_as_steps(alone: list[Token], batched: list[Token],
                                  layers: tuple[int, ...]) -> None:  # fmt: skip
    """The same tokens; each step's rows and statistics within float32's rounding of a
    block's products summed in another order."""
    assert [t.token_id for t in batched] == [t.token_id for t in alone]
    for one, many in zip(alone[1:], batched[1:], strict=True):
        for layer in layers:
            np.testing.assert_allclose(many.attention[layer], one.attention[layer], atol=1e-5)
            np.testing.assert_allclose(many.head_stats[layer], one.head_stats[layer], atol=1e-5)
