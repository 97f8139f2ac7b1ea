"""One build of a package at a time, and none left behind.

A package here is a file that takes minutes of CPU to make once and is then kept (the
compiled decode step, engine/step/compiled.py). It is built by a process of its own, so
that a build still useful after the app closes can finish, and every launch that finds the
package missing comes through `build_once`:

- a build holds `<package>.lock`, an OS file lock (filelock's flock) that the kernel releases
  when the holder ends, however it ends, and writes its PID in it; a launch that finds the
  lock held waits for that build and reuses its package instead of starting a second one
  (three launches in two minutes used to leave four compiles of one package running);
- a builder started meanwhile (two launches racing) takes the lock after the first build,
  finds the package there and ends without building (`building` yields False);
- the builder writes into `<package>.<pid>.partial/` and renames the finished file into
  place: a killed build leaves only that folder, which the next launch deletes once no
  process of that PID lives (or, holding the package's lock, whatever PID it names).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
from filelock import FileLock, Timeout

log = logging.getLogger(__name__)

PARTIAL = ".partial"


def lock_path(package: Path) -> Path:
    return package.with_name(f"{package.name}.lock")


def partial_folder(package: Path, pid: int | None = None) -> Path:
    """Where the build of `package` by process `pid` (this one by default) writes."""
    return package.with_name(f"{package.name}.{pid or os.getpid()}{PARTIAL}")


def holder(package: Path) -> int | None:
    """The PID of the process building `package` now, or None (0 if it wrote none yet)."""
    lock = FileLock(lock_path(package), blocking=False)
    try:
        with lock:
            return None
    except Timeout:
        text = _read(lock_path(package))
        return int(text) if text.isdigit() else 0


@contextlib.contextmanager
def building(package: Path) -> Iterator[bool]:
    """The builder's side: hold the package's lock (after a build under way ends), and yield
    whether the package is still to be built (False: the build waited for made it)."""
    package.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(lock_path(package)):
        lock_path(package).write_text(str(os.getpid()))  # who builds, for a launch that waits
        for stale in _partials(package):  # none is live while this process holds the lock
            shutil.rmtree(stale, ignore_errors=True)
        yield not package.exists()


def sweep(folder: Path) -> None:
    """Delete the partial output of builds whose process is gone (killed mid-build)."""
    for partial in folder.glob(f"*{PARTIAL}"):
        pid = partial.name.removesuffix(PARTIAL).rsplit(".", 1)[-1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            log.info("removing %s, left by a build that did not finish", partial.name)
            shutil.rmtree(partial, ignore_errors=True)


def build_once(
    package: Path, command: Sequence[str], cwd: Path
) -> subprocess.CompletedProcess[str] | None:
    """The launcher's side: make sure `package` exists, running `command` (a builder that
    holds `building`) in a session of its own if no other build makes it. Returns the
    builder's result, or None where the package was kept or another launch's build made it."""
    sweep(package.parent)
    _wait_for_running(package)
    if package.exists():
        return None
    log.info("building %s in the background (once; a few minutes)", package.name)
    with tempfile.TemporaryFile("w+") as errors:  # not a pipe: the build may outlive us
        process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=errors, cwd=cwd, start_new_session=True
        )
        process.wait()
        errors.seek(0)
        return subprocess.CompletedProcess(list(command), process.returncode, "", errors.read())


def _wait_for_running(package: Path) -> None:
    """Wait for the build of `package` another launch started, if one is under way."""
    pid = holder(package)
    if pid is None:
        return
    log.info("waiting for the build of %s that process %d started", package.name, pid)
    with FileLock(lock_path(package)):
        pass


def _partials(package: Path) -> list[Path]:
    return list(package.parent.glob(f"{package.name}.*{PARTIAL}"))


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""
