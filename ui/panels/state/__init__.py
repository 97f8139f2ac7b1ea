"""What the internals panels draw, kept without Qt: fed by engine events, read by the panels.

An import contract in pyproject.toml keeps Qt and pyqtgraph out of this package, so the state
can be built and tested anywhere the engine runs.
"""

from ui.panels.state.arrays import GrowableArray
from ui.panels.state.attention import ATTENTION_CELLS, AttentionRows, HeadStats
from ui.panels.state.internals import (
    ATTENTION,
    KEYS,
    KV,
    MODEL,
    NEXT_TOKEN,
    PLACEMENT,
    ROOFLINE,
    TIMING,
    InternalsState,
)
from ui.panels.state.placement import PlacementTrace
from ui.panels.state.roofline import RooflineTrace
from ui.panels.state.timing import ReplyTiming

__all__ = [
    "ATTENTION",
    "ATTENTION_CELLS",
    "KEYS",
    "KV",
    "MODEL",
    "NEXT_TOKEN",
    "PLACEMENT",
    "ROOFLINE",
    "TIMING",
    "AttentionRows",
    "GrowableArray",
    "HeadStats",
    "InternalsState",
    "PlacementTrace",
    "ReplyTiming",
    "RooflineTrace",
]
