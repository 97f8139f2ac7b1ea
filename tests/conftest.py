"""Fixtures for every test: Qt runs headless, and no test may leave a QThread running."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before any QApplication exists: tests never need (or may not have) a display.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")

# pytest puts this folder on sys.path for this file, where tests/app, tests/engine and tests/ui
# would pass for namespace packages named app, engine and ui. The repository root goes first,
# so those names stay the real packages and `tests.ui.fakes` imports under plain `pytest` too.
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _no_qthread_left_running(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail the test if a QThread it started is still running when it ends.

    Engine tests never import Qt, so they pay nothing here.
    """
    qtcore = sys.modules.get("PySide6.QtCore")
    if qtcore is None:
        yield
        return
    with _garbage_collected_between_tests():
        yield from _threads_checked(qtcore, monkeypatch)


@contextlib.contextmanager
def _garbage_collected_between_tests() -> Iterator[None]:
    """Collect reference cycles only once a Qt test's threads and windows are gone.

    Each test builds and drops whole windows; left to the collector's own timing, their cycles
    were once collected inside a later test's event loop while its worker thread ran, and the
    interpreter died there (a segmentation fault in "Garbage-collecting", 1 full run in 4).
    The app builds its window once, so it never drops such cycles while it runs.
    """
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()
        # What survives (modules, session fixtures) is not walked again: app.collector
        gc.freeze()


def _threads_checked(qtcore, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    started: weakref.WeakSet = weakref.WeakSet()
    original_start = qtcore.QThread.start

    def start(self, *args, **kwargs):
        started.add(self)
        return original_start(self, *args, **kwargs)

    monkeypatch.setattr(qtcore.QThread, "start", start)
    yield
    import shiboken6

    running = [t for t in list(started) if shiboken6.isValid(t) and t.isRunning()]
    for thread in running:  # stop them so one leak does not fail every later test
        thread.quit()
        thread.wait(5000)
    if running:
        names = ", ".join(t.objectName() or type(t).__name__ for t in running)
        pytest.fail(f"test left {len(running)} QThread(s) running: {names}", pytrace=False)


from tests.models import TINY_ARCHITECTURES, make_tiny  # noqa: E402

# -- models ---------------------------------------------------------------------------------
# The bundled model is dequantised once into a cache beside the tests (not the user's cache),
# and tiny random-weight models of four architectures reuse its tokenizer: no network needed.

# Where `make models` put the real models: the user's cache, read before it is redirected below.
_USER_CACHE_DIR = os.environ.get("GLASSBOX_CACHE_DIR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Loads decode eagerly unless a test compiles the step itself (test_compiled_decode): a
# background compile would take a core for a minute or two in the middle of other tests.
os.environ.setdefault("GLASSBOX_COMPILE", "0")
# Conversations, logs and Qt's saved layout go to a scratch folder, never the user's own,
# removed when the run ends (pytest_sessionfinish).
_scratch = tempfile.mkdtemp(prefix="glassbox-tests-")
os.environ.setdefault("GLASSBOX_DATA_DIR", os.path.join(_scratch, "data"))
os.environ.setdefault("XDG_CONFIG_HOME", os.path.join(_scratch, "config"))
os.environ.setdefault(
    "GLASSBOX_CACHE_DIR",
    os.path.join(os.path.dirname(os.path.dirname(__file__)), ".pytest_cache", "glassbox-cache"),
)


@pytest.fixture
def int4_layouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fast weights repacked for torch's int4 kernel, as where the GGML kernels do not run
    (engine/weights/ggml_kernel.py): for the tests of those layouts, on any CPU."""
    monkeypatch.setenv("GLASSBOX_GGML_KERNELS", "0")


@pytest.fixture(scope="session")
def bundled():
    """The real bundled SmolLM2-135M-Instruct in exact precision (the transformers reference
    that `generate` and eager attention check), loaded once for the whole run."""
    from engine.load.loader import load_model
    from engine.settings import LoadRequest

    return load_model(LoadRequest(spec="bundled", device="cpu", precision="exact"))


@pytest.fixture(scope="session")
def bundled_fast():
    """The bundled model in fast precision: Glassbox's own model on its 4-bit weights."""
    from engine.load.loader import load_model
    from engine.settings import LoadRequest

    return load_model(LoadRequest(spec="bundled", device="cpu", precision="fast"))


@pytest.fixture(scope="session")
def tokenizer():
    """The bundled model's tokenizer alone (tiny models share it): no weights loaded.

    $GLASSBOX_TEST_TOKENIZER names a folder holding it instead (saved with save_pretrained),
    for a machine without the bundled package, such as a GPU machine the tests are copied to.
    """
    from engine.disk.cache_folder import default_cache_dir
    from engine.load.loader import bundled_gguf_path, gguf_tokenizer

    folder = os.environ.get("GLASSBOX_TEST_TOKENIZER")
    if folder:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(folder)
    else:
        tokenizer = gguf_tokenizer(bundled_gguf_path(), default_cache_dir(), lambda *_: None)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@pytest.fixture(scope="session")
def tiny_folder(tokenizer, tmp_path_factory) -> Path:
    """A tiny random llama saved the way a downloaded model sits on disk."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny(tokenizer, "llama").model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _real_model(name: str) -> Path:
    """The path of a real model `glassbox models fetch` assembled, or a skip saying how."""
    import platformdirs

    from app.model_fetch import MODELS, fetched, models_dir

    user_cache = _USER_CACHE_DIR or platformdirs.user_cache_dir("glassbox", appauthor=False)
    folder = models_dir(Path(user_cache).expanduser())
    path = fetched(MODELS[name], folder)
    if path is None:
        pytest.skip(f"run `make models` to fetch {MODELS[name].title} (not in {folder})")
    return path


@pytest.fixture(scope="session")
def real_qwen() -> Path:
    """The real Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (1.1 GB), if fetched."""
    return _real_model("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def real_gemma() -> Path:
    """The real Gemma-3-270M Q4_K_M GGUF (253 MB; no chat template in the file), if fetched."""
    return _real_model("gemma-3-270m")


BUNDLED_FIXTURES = {"bundled", "bundled_fast"}
REAL_MODEL_FIXTURES = {"real_qwen", "real_gemma"}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_scratch, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that load the bundled model's weights are `bundled` (left out by `make test-fast`);
    those on a fetched real model are `real_models` (skipped where it is not fetched)."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if BUNDLED_FIXTURES & fixtures:
            item.add_marker(pytest.mark.bundled)
        if REAL_MODEL_FIXTURES & fixtures:
            item.add_marker(pytest.mark.real_models)


@pytest.fixture(params=TINY_ARCHITECTURES)
def tiny(request, tokenizer):
    """A tiny random model of each architecture in turn."""
    return make_tiny(tokenizer, request.param)
