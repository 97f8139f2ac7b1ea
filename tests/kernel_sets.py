"""Code run under one of torch's CPU kernel sets: torch picks the set once per process
($ATEN_CPU_CAPABILITY), so each set is checked in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

KERNEL_SETS = ("avx2", "avx512", "default")


def report_under(kernel_set: str, code: str) -> dict[str, Any]:
    """Run `code` in a new Python under `kernel_set`: the JSON object its last line prints."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel_set}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report
