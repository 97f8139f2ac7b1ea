"""The bundled model's shape (app/bench/shapes.py), written once for the bench tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.bench.shapes import SHAPES, shape_file


@pytest.fixture(scope="session")
def shapes_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes")


@pytest.fixture(scope="session")
def bundled_shape(shapes_cache) -> Path:
    return shape_file(SHAPES["bundled"], shapes_cache)


def _load(path: Path, cache: Path, precision: str):
    from engine.load.loader import load_model
    from engine.settings import LoadRequest

    request = LoadRequest(spec=str(path), precision=precision, compiled=False)
    return load_model(request, cache_dir=cache)


@pytest.fixture(scope="session")
def bundled_shape_fast(bundled_shape, shapes_cache):
    return _load(bundled_shape, shapes_cache, "fast")


@pytest.fixture(scope="session")
def bundled_shape_exact(bundled_shape, shapes_cache):
    return _load(bundled_shape, shapes_cache, "exact")
