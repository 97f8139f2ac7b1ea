"""The layering rules hold: the import-linter contracts pass, they do catch a violation, and
importing the engine loads no Qt at all."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_contracts_are_kept():
    assert LINT_IMPORTS.is_file(), f"{LINT_IMPORTS} is missing: install the test extras"
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def lint_a_copy(tmp_path: Path, change: Callable[[Path], None]) -> subprocess.CompletedProcess:
    """lint-imports on a copy of the code that `change` has edited."""
    ignore = shutil.ignore_patterns("__pycache__")
    for package in ("engine", "app", "ui"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    change(tmp_path)
    return lint_imports(tmp_path, {**os.environ, "PYTHONPATH": str(tmp_path)})


def test_import_contracts_catch_the_engine_importing_qt(tmp_path):
    """A copy of the code with one forbidden import: the same contracts must fail on it."""

    def leak(root: Path) -> None:
        (root / "engine" / "leak.py").write_text("import PySide6.QtCore  # noqa: F401\n")

    result = lint_a_copy(tmp_path, leak)
    assert result.returncode != 0
    assert "engine.leak -> PySide6" in result.stdout


def test_import_contracts_catch_a_circle_inside_the_engine(tmp_path):
    """The session imports the settings; the settings importing the session back, even
    inside a function (how the circles used to hide), breaks the no-circles contract."""

    def circle(root: Path) -> None:
        with (root / "engine" / "settings.py").open("a") as settings:
            settings.write(
                "\n\ndef _circle() -> None:\n    from engine.generate import session  # noqa\n"
            )

    result = lint_a_copy(tmp_path, circle)
    assert result.returncode != 0
    assert "No import circles inside a package BROKEN" in result.stdout
    assert "No cycles are allowed in engine." in result.stdout


def test_import_contracts_catch_a_part_importing_upward(tmp_path):
    """The model sits below the session loop: the model importing the session breaks the
    engine's layers contract, not only the no-circles one."""

    def upward(root: Path) -> None:
        (root / "engine" / "model" / "upward.py").write_text(
            "from engine.generate import session  # noqa: F401\n"
        )

    result = lint_a_copy(tmp_path, upward)
    assert result.returncode != 0
    assert "The engine's parts import downward only BROKEN" in result.stdout
    assert "engine.model.upward -> engine.generate.session" in result.stdout


def test_importing_the_engine_loads_no_qt():
    code = (
        "import importlib, pkgutil, sys\n"
        "import engine\n"
        "for module in pkgutil.walk_packages(engine.__path__, 'engine.'):\n"
        "    importlib.import_module(module.name)\n"
        "qt = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "            ('PySide6', 'shiboken6', 'pyqtgraph', 'superqt', 'app', 'ui'))\n"
        "print('loaded:', qt)\n"
        "sys.exit(1 if qt else 0)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "loaded: []" in result.stdout
