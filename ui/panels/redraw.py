"""Which panels must redraw: the state revisions each one last drew, plus its own UI changes."""

from __future__ import annotations

import math
import time

from PySide6.QtWidgets import QWidget

from ui.panels.state import MODEL, InternalsState


class RedrawTracker:
    """Remembers which state revisions a panel last drew, plus its own pending UI changes."""

    def __init__(self, state: InternalsState, *keys: str) -> None:
        self._state = state
        self._keys = (MODEL, *keys)
        self._drawn: tuple[int, ...] | None = None
        self._dirty = True

    def mark(self) -> None:
        """Something on the panel itself changed (a selection): redraw on the next tick."""
        self._dirty = True
        self._state.panel_changed()

    @property
    def stale(self) -> bool:
        return self._dirty or self._current() != self._drawn

    def drawn(self, revisions: tuple[int, ...]) -> None:
        self._drawn = revisions
        self._dirty = False

    def snapshot(self) -> tuple[int, ...]:
        return self._current()

    def _current(self) -> tuple[int, ...]:
        return tuple(self._state.revision(key) for key in self._keys)


class StatePanel(QWidget):
    """A panel drawn from the internals state: due for a redraw when a revision it follows, or
    a choice on the panel itself, changed since it last drew (InternalsView's timer asks)."""

    def __init__(self, state: InternalsState, key: str, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self._state = state
        self.tracker = RedrawTracker(state, key)
        # A redraw that stopped at its share of a frame sets this: the frame draws the panel
        # again in its next slice, after the event loop has had its turn.
        self.unfinished = False

    def needs_redraw(self) -> bool:
        return self.unfinished or self.tracker.stale

    def redraw(self) -> None:
        raise NotImplementedError


class Throttle:
    """A slow summary (a mean over the reply, a cloud, a timeline) that redraws at most once an
    interval, and at once when its shape changes: a tuple naming its series, a choice or its
    size, passed in by the panel (held as a callable it would keep the panel alive in a cycle).
    `pending` says new data arrived since it was last drawn."""

    def __init__(self) -> None:
        self._drawn_at = -math.inf
        self._drawn_shape: tuple[object, ...] = ()
        self.pending = False

    def due(self, interval_s: float, shape: tuple[object, ...]) -> bool:
        late = time.monotonic() - self._drawn_at >= interval_s
        return late or shape != self._drawn_shape

    def drawn(self, shape: tuple[object, ...]) -> None:
        self._drawn_at, self._drawn_shape = time.monotonic(), shape
        self.pending = False
