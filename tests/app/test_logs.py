"""The log file: where the data folder cannot be made, the program logs to stderr only."""

from __future__ import annotations

import logging

from app import logs
from app.paths import DATA_DIR_ENV


def test_a_data_folder_that_cannot_be_made_gives_no_log_file_and_says_why(monkeypatch, tmp_path):
    (tmp_path / "data").write_text("a file, not a folder")
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "data" / "glassbox"))
    handler, problem = logs.log_file()
    assert handler is None and isinstance(problem, OSError)


def test_a_data_folder_holds_the_log_file(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    handler, problem = logs.log_file()
    assert problem is None and isinstance(handler, logging.Handler)
    handler.close()
    assert (tmp_path / logs.LOG_NAME).exists()
