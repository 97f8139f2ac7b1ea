"""Live views of what the model does while a reply streams: timing, KV cache, attention, and
next-token candidates, fed from engine events and redrawn by a timer."""

from ui.panels.buffers import InternalsState
from ui.panels.docks import InternalsView, build_docks, dock_widgets
from ui.panels.timing import WITH_CACHE, WITHOUT_CACHE, cache_label

__all__ = [
    "WITHOUT_CACHE",
    "WITH_CACHE",
    "InternalsState",
    "InternalsView",
    "build_docks",
    "cache_label",
    "dock_widgets",
]
