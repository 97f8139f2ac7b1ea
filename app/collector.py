"""Python's cyclic garbage collector at start-up.

Importing torch (or Qt and pyqtgraph) makes hundreds of thousands of objects that live as long
as the process. Each automatic collection during those imports, and every full collection
after them, walks all of them again, which makes both the imports and loading a model
noticeably slower.

So the collector is paused while a process starts, and what the imports made is then frozen:
moved out of the collector's reach for good (`gc.freeze`), as module objects never become
garbage. Objects made later (a model, a conversation) stay collectable, so a model that is
replaced is still freed.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector is as it was after it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
