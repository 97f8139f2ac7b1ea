"""Events as JSON-ready dicts: the terminal's --json lines, traces and the store use this."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from engine.events import Event, Failed, Finished, PrefillDone, Token

EVENT_NAMES = {PrefillDone: "prefill", Token: "token", Failed: "failed", Finished: "finished"}


def plain(value: Any) -> Any:
    """Numpy arrays to nested lists, dict keys to strings, tuples to lists, recursively."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    return value


def event_to_dict(event: Event) -> dict[str, Any]:
    """{"event": "token", ...every field...}; Finished also carries its derived rates."""
    data = {"event": EVENT_NAMES[type(event)], **plain(event)}
    if isinstance(event, Finished):
        data["finish_reason"] = data.pop("reason")
        data["decode_tokens_per_s"] = event.decode_tokens_per_s
        data["prefill_tokens_per_s"] = event.prefill_tokens_per_s
    elif isinstance(event, PrefillDone):
        data["tokens_per_s"] = event.tokens_per_s
    return data
