"""Which panels must redraw: the state revisions each one last drew, plus its own UI changes."""

from __future__ import annotations

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
