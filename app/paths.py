"""Where Glassbox keeps its files: the per-user data folder.

The platform's usual place (via platformdirs) unless GLASSBOX_DATA_DIR names another folder,
which is how tests and portable installs keep their files apart. Dequantised models go to the
cache folder that engine.disk.cache_folder.default_cache_dir() names (GLASSBOX_CACHE_DIR).
"""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "glassbox"
DATA_DIR_ENV = "GLASSBOX_DATA_DIR"
DATABASE_NAME = "conversations.sqlite3"


def _resolve(env_name: str, default: str) -> Path:
    override = os.environ.get(env_name, "").strip()
    folder = Path(override).expanduser() if override else Path(default)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def data_dir() -> Path:
    """The folder for conversations and settings, created if missing."""
    return _resolve(DATA_DIR_ENV, platformdirs.user_data_dir(APP_NAME, appauthor=False))


def database_path() -> Path:
    """The conversation database inside the data folder."""
    return data_dir() / DATABASE_NAME
