"""Fixtures for the app tests."""

from __future__ import annotations

from tests.app.process_check import no_engine_process_left  # noqa: F401 - autouse
