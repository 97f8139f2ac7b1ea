"""Where the engine keeps what it derives once and reads at every start: converted tokenizers,
repacked weights, compiled decode steps, the machine's measured peaks.

A module of its own (platformdirs only, no torch) so that everything that keeps files there
asks one rule without importing the loader.
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def default_cache_dir() -> Path:
    """Where dequantised models are kept: $GLASSBOX_CACHE_DIR, else the platform's user cache."""
    override = os.environ.get("GLASSBOX_CACHE_DIR")
    default = platformdirs.user_cache_dir("glassbox", appauthor=False)
    return Path(override).expanduser() if override else Path(default)
