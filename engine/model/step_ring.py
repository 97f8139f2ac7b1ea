"""The last steps of a reply, kept in the engine so the window can pull what it draws.

A step's payloads (its attention rows per watched layer today; any per-step data later, e.g.
each layer's residual for a logit lens) are kept by (step, kind), as the generation made them
(tensors on the model's device: nothing is copied to the host unless asked for), within a byte
cap: the oldest steps leave first. The generation thread puts; the engine server's threads get
(a panel's latest rows, a selected step's), so every access holds the ring's lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from engine.events import Attention, frozen_array

ATTENTION = "attention"  # layer -> [heads, keys] rows of the step's query (tensor or array)
# layer -> [heads, rows, keys] the prompt's matrix (step 0), every watched layer's: a panel that
# starts drawing a layer mid-reply gets that layer's prompt rows from here
PROMPT = "prompt"
RESIDUALS = "residuals"  # ([layers, dim] each layer's output, the token chosen): the lens's


def payload_bytes(payload: Any) -> int:
    """The bytes of a tensor or array, or of a dict / list / tuple of them (duck-typed: the
    ring holds torch tensors or numpy arrays alike)."""
    if hasattr(payload, "element_size"):  # a torch tensor
        return int(payload.numel() * payload.element_size())
    if isinstance(payload, dict):
        return sum(payload_bytes(value) for value in payload.values())
    if isinstance(payload, list | tuple):
        return sum(payload_bytes(value) for value in payload)
    return int(getattr(payload, "nbytes", 0))


class StepRing:
    """Payloads of recent steps of one reply, keyed by (step, kind), at most `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._steps: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._bytes: dict[int, int] = {}
        self._total = 0  # the sum of _bytes
        self._lock = threading.Lock()
        self.reply = 0  # counts replies: a step number means something within one only
        self.latest: int | None = None  # the last step put

    @property
    def bytes(self) -> int:
        with self._lock:
            return self._total

    def start_reply(self, max_bytes: int | None = None) -> None:
        """Forget every step: a new reply numbers its steps from 0 again."""
        with self._lock:
            self._steps.clear()
            self._bytes.clear()
            self._total = 0
            self.latest = None
            self.reply += 1
            if max_bytes is not None:
                self.max_bytes = max_bytes

    def put(self, step: int, kind: str, payload: Any) -> None:
        """Keep `payload` as step `step`'s `kind`; older steps leave while over the cap (a
        payload larger than the cap alone is not kept)."""
        size = payload_bytes(payload)
        with self._lock:
            if size > self.max_bytes:
                return
            kinds = self._steps.setdefault(step, {})
            change = size - payload_bytes(kinds.get(kind))
            self._bytes[step] = self._bytes.get(step, 0) + change
            self._total += change
            kinds[kind] = payload
            self._steps.move_to_end(step)
            self.latest = step if self.latest is None else max(self.latest, step)
            while self._total > self.max_bytes and len(self._steps) > 1:
                oldest, _ = self._steps.popitem(last=False)
                self._total -= self._bytes.pop(oldest)

    def get(self, step: int, kind: str) -> Any | None:
        """Step `step`'s `kind`, or None: never kept, or aged out."""
        with self._lock:
            return self._steps.get(step, {}).get(kind)

    def steps(self) -> list[int]:
        with self._lock:
            return list(self._steps)


def host_rows(
    ring: StepRing, step: int, layers: frozenset[int] | None = None, kind: str = ATTENTION
) -> Attention | None:
    """Step `step`'s attention rows from `ring` as read-only host arrays (only `layers`, if
    given), or None when the step is not (or no longer) there. `kind` PROMPT: the prompt's
    matrix (step 0)."""
    rows = ring.get(step, kind)
    if rows is None:
        return None
    return {
        layer: frozen_array(_host(row))
        for layer, row in sorted(rows.items())
        if layers is None or layer in layers
    }


def _host(row: Any) -> np.ndarray:
    return row.cpu().numpy() if hasattr(row, "cpu") else np.asarray(row)
