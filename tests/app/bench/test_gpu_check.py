"""scripts/gpu-check.sh's CPU-side logic, run dry: what it would run on a GPU machine, and that
its parts' time limits fit the 8 minutes a check has."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from app.bench.shapes import SHAPES

SCRIPT = Path(__file__).resolve().parents[3] / "scripts" / "gpu-check.sh"


def dry_run(out: Path, *options: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(out), "--dry-run", *options],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    return done, json.loads((out / "gpu-check.json").read_text())


def test_a_dry_run_reports_the_cuda_tests_and_each_shapes_bench_within_8_minutes(tmp_path):
    done, report = dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    assert report["dry_run"] is True
    steps = {step["name"]: step for step in report["steps"]}
    assert "-k cuda" in steps["pytest"]["command"]
    files = [word for word in steps["pytest"]["command"].split() if word.startswith("tests/")]
    assert "tests/engine/gguf/test_torch_blocks.py" in files  # the device's dequantiser
    assert "tests/engine/generate/test_run_ahead.py" in files  # steps launched ahead
    assert all((SCRIPT.parents[1] / file).is_file() for file in files)
    for name in SHAPES:
        command = steps[f"bench-{name}"]["command"]
        assert f"--model shape:{name}" in command
        assert "--device cuda" in command
        assert f"--output {tmp_path}/bench-{name}.json" in command
    assert "--fast-only" in steps["bench-qwen2.5-1.5b"]["command"]
    # The int4 comparison takes what the others leave of the 8 minutes (all of it, run dry)
    optional = steps.pop("bench-bundled-int4")
    assert "--int4" in optional["command"] and "--model shape:bundled" in optional["command"]
    assert 60 <= optional["limit_s"] <= 8 * 60 - 30
    assert sum(step["limit_s"] for step in steps.values()) + 30 <= 8 * 60  # 30: the install
    assert report["installed"] == []  # this environment has every module; nothing installed


def test_the_device_and_a_wrong_option_are_taken_as_given(tmp_path):
    done, report = dry_run(tmp_path, "--device", "cpu")
    assert done.returncode == 0
    assert all("--device cpu" in s["command"] for s in report["steps"] if s["name"] != "pytest")
    wrong = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path), "--fast"], capture_output=True, text=True, check=False
    )
    assert wrong.returncode == 2
    assert "unknown option --fast" in wrong.stderr
