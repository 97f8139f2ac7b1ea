"""Log to stderr and to a file in the user's data folder, so engine-thread errors are kept."""

from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler

from app.paths import data_dir

LOG_NAME = "glassbox.log"


def setup_logging(level: int = logging.INFO) -> None:
    root = logging.getLogger()
    if root.handlers:
        return
    root.setLevel(level)
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    for handler in (
        logging.StreamHandler(),
        RotatingFileHandler(data_dir() / LOG_NAME, maxBytes=2_000_000, backupCount=2),
    ):
        handler.setFormatter(formatter)
        root.addHandler(handler)
