"""A stand-in for `python -m engine.load.compile_step` in tests of engine/disk/build_lock.py: it
holds the package's lock as the real builder does, and "builds" in seconds.

`python -m tests.engine.load.fake_build build PACKAGE LOG GATE`: write the PID in LOG, wait for
the GATE file, then put the package in place. `... launch PACKAGE LOG GATE`: what a start of
the app does when the package is missing (build_lock.build_once with that builder), saying
what it did on stdout, a line each.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import time
from pathlib import Path

from engine.disk import build_lock

ROOT = Path(__file__).resolve().parents[3]


def build(package: Path, log: Path, gate: Path) -> int:
    with build_lock.building(package) as missing:
        if not missing:
            return 0
        scratch = build_lock.partial_folder(package)
        scratch.mkdir()
        with log.open("a") as builds:
            builds.write(f"{os.getpid()}\n")
        while not gate.exists():  # the test says when the build may end
            time.sleep(0.01)
        (scratch / "package").write_text("built")
        (scratch / "package").replace(package)
        shutil.rmtree(scratch)
    return 0


def launch(package: Path, log: Path, gate: Path) -> int:
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    builder = [
        sys.executable,
        "-m",
        "tests.engine.load.fake_build",
        "build",
        str(package),
        str(log),
    ]
    result = build_lock.build_once(package, [*builder, str(gate)], cwd=ROOT)
    print("kept" if result is None else f"built {result.returncode}", flush=True)
    return 0


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    package, log, gate = map(Path, paths)
    sys.exit(build(package, log, gate) if command == "build" else launch(package, log, gate))
