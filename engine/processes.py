"""Whether a process still lives: what decides that a file or folder named after the process
that made it was left behind (a killed build's partial output, a killed window's shared
arrays) and may go."""

from __future__ import annotations

import os


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only the checks, nothing is sent
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
