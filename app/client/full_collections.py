"""No full garbage collection in the window's process while events stream into it.

A full (generation 2) collection walks every object the process holds, and a window that has
shown long replies holds hundreds of thousands (tokens, their candidates, panel state): each one
pauses the GUI thread for 50-150 ms, far past a frame, and at a fast model's rate they come
every second or so, collecting almost nothing. A reply's objects are freed by their reference
counts anyway; only reference cycles wait for a collection. So while any holder streams (a
`Delivery` whose jobs are under way) the oldest generation is left alone (the young ones are
still collected: they are small), and once none has streamed for IDLE_MS one full collection
runs in the idle GUI thread and the collector's thresholds are as before.

CPython's collector is the process's, so the holders are counted here, in the GUI thread.
"""

from __future__ import annotations

import gc

from PySide6.QtCore import QTimer

IDLE_MS = 1000  # streaming stopped this long: the full collection that was held runs
# Generation 2 is collected once this many generation-1 collections have run (the default
# is 10, each after ~7,000 allocations): held, practically never.
HELD_THRESHOLD = 2**30

_holders: set[int] = set()
_saved: int | None = None  # the generation-2 threshold while held
_streams = 0  # counts holds: an idle wait started before the latest hold is stale


def hold(holder: object) -> None:
    """`holder` streams: no full collection until every holder has released."""
    global _saved, _streams
    _streams += 1
    _holders.add(id(holder))
    if _saved is None:
        first, second, _saved = gc.get_threshold()
        gc.set_threshold(first, second, HELD_THRESHOLD)


def release(holder: object) -> None:
    """`holder` no longer streams; the last one out starts the idle wait for the collection."""
    _holders.discard(id(holder))
    if not _holders and _saved is not None:
        streams = _streams
        QTimer.singleShot(IDLE_MS, lambda: _collect(streams))


def held() -> bool:
    return _saved is not None


def _collect(streams: int) -> None:
    """Thresholds as before, and the full collection that was held, if nothing streamed since
    the wait began."""
    global _saved
    if _holders or _saved is None or streams != _streams:
        return
    first, second, _ = gc.get_threshold()
    gc.set_threshold(first, second, _saved)
    _saved = None
    gc.collect()
