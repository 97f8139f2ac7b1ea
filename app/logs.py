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
    handlers: list[logging.Handler] = [logging.StreamHandler()]
    file, problem = log_file()
    handlers += [file] if file is not None else []
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    if problem is not None:
        logging.getLogger(__name__).warning(
            "No log file (%s): the log goes to stderr only", problem
        )


def log_file() -> tuple[logging.Handler | None, OSError | None]:
    """The log file's handler in the data folder, or why there can be none (a data folder that
    cannot be made or written: the program runs all the same)."""
    try:
        return RotatingFileHandler(data_dir() / LOG_NAME, maxBytes=2_000_000, backupCount=2), None
    except OSError as error:
        return None, error
