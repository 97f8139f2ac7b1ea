"""One build of a compiled package at a time, none left behind (engine/disk/build_lock.py): starts
of the app in processes of their own, with a builder that takes seconds (fake_build.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine.disk import build_lock
from tests.engine.load.fake_build import ROOT

pytestmark = pytest.mark.timeout(180)


@dataclass
class Files:
    package: Path
    log: Path  # a line per build that began: the builder's PID
    gate: Path  # the builds end once it exists

    def builds(self) -> list[int]:
        return [int(line) for line in self.log.read_text().split()] if self.log.exists() else []

    def launch(self, role: str = "launch") -> subprocess.Popen[str]:
        """A start of the app that finds the package missing (or with "build", a builder)."""
        paths = (str(self.package), str(self.log), str(self.gate))
        command = [sys.executable, "-m", "tests.engine.load.fake_build", role, *paths]
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)


@pytest.fixture
def files(tmp_path: Path) -> Files:
    folder = tmp_path / "compiled"
    return Files(folder / "step.pt2", tmp_path / "builds.log", tmp_path / "gate")


def wait_until(condition: Callable[[], object], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def last_line(launch: subprocess.Popen[str]) -> str:
    out, _ = launch.communicate(timeout=120)
    return out.strip().splitlines()[-1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_three_launches_in_a_row_leave_exactly_one_build(files):
    first = files.launch()
    wait_until(lambda: len(files.builds()) == 1)
    second, third = files.launch(), files.launch()
    for waiting in (second, third):  # they find the build under way and wait for it
        assert waiting.stdout is not None
        line = waiting.stdout.readline()
        assert line.startswith(
            f"waiting for the build of step.pt2 that process {files.builds()[0]}"
        )
    files.gate.touch()
    assert [last_line(launch) for launch in (first, second, third)] == ["built 0", "kept", "kept"]
    assert len(files.builds()) == 1 and files.package.read_text() == "built"
    assert list(files.package.parent.glob("*.partial")) == []
    assert build_lock.holder(files.package) is None


def test_a_builder_started_during_a_build_waits_and_builds_nothing(files):
    """Two starts racing past the check both start a builder: the second takes the lock
    after the first build and finds the package made."""
    first = files.launch("build")
    wait_until(lambda: len(files.builds()) == 1)
    second = files.launch("build")
    files.gate.touch()
    assert first.wait(120) == 0 and second.wait(120) == 0
    assert len(files.builds()) == 1 and files.package.read_text() == "built"


def test_a_build_outliving_its_launch_finishes_once(files):
    """The app closes mid-build (here: killed outright): the build goes on, and the next start
    uses its package instead of building another."""
    first = files.launch()
    wait_until(lambda: len(files.builds()) == 1)
    first.kill()
    first.communicate(timeout=120)
    (builder,) = files.builds()
    assert alive(builder) and build_lock.holder(files.package) == builder
    files.gate.touch()
    wait_until(lambda: files.package.exists() and build_lock.holder(files.package) is None)
    assert last_line(files.launch()) == "kept"
    assert files.builds() == [builder]


def test_a_build_killed_midway_is_cleaned_up_at_the_next_start(files):
    first = files.launch()
    wait_until(lambda: len(files.builds()) == 1)
    (killed,) = files.builds()
    partial = build_lock.partial_folder(files.package, killed)
    assert partial.is_dir()
    os.kill(killed, signal.SIGKILL)
    assert last_line(first) == "built -9"
    assert partial.is_dir() and not files.package.exists()  # what the killed build left
    files.gate.touch()
    second = files.launch()
    out, _ = second.communicate(timeout=120)
    assert f"removing {partial.name}, left by a build that did not finish" in out
    assert out.strip().endswith("built 0")
    assert not partial.exists() and files.package.read_text() == "built"
    assert len(files.builds()) == 2


def test_the_sweep_keeps_the_partial_output_of_a_live_build(tmp_path):
    package = tmp_path / "step.pt2"
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)  # fmt: skip
    dead = build_lock.partial_folder(package, int(ended.stdout))
    live = build_lock.partial_folder(package)  # this process's
    for folder in (dead, live):
        folder.mkdir()
    build_lock.sweep(tmp_path)
    assert not dead.exists() and live.is_dir()
