"""Large arrays from the engine to the window through shared memory instead of the pipe.

A long prompt's attention rows are tens of MB (256 rows x 1,452 keys x 9 heads x 4 layers is
51 MB). Through the pipe they were copied three times (into the pipe, out of it, and the
zeroed buffer it was read into): CPU time between the two processes, taken from the model
decoding on the same cores, which slowed decoding where nothing else did. Here the engine
writes such an array once
into a file in a folder under /dev/shm (memory, not disk) and sends its name; the window maps
the file read-only and unlinks it at once, so the memory is the kernel's to free as soon as
the window lets go of the array, and nothing is left behind by a reply the window has read.

The window's process makes the folder (`SharedFolder.create`) before it starts the engine and
removes it when the engine is gone, whichever side died; folders of processes that no longer
exist are removed at the next start. Where there is no /dev/shm (macOS, Windows), or a write
fails (a full /dev/shm), or the window has not taken the last few, the array goes through the
pipe as before.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

SHARED_ROOT = Path("/dev/shm")
MIN_SHARED_BYTES = 2**20  # smaller arrays (a token's rows) cost less through the pipe
# Files the window has not taken yet, past which arrays wait in the pipe again: a write to the
# pipe blocks while the window is behind, and so holds the engine up (its back-pressure).
MAX_WAITING_FILES = 16
PREFIX = "glassbox-"


class SharedFolder:
    """The engine's folder of arrays in transit; the window's process owns it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._names = itertools.count()

    @classmethod
    def create(cls, root: Path = SHARED_ROOT) -> SharedFolder | None:
        """A new folder for this process's engine, or None where shared memory is not here."""
        if not root.is_dir():
            return None
        remove_stale(root)
        try:
            made = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=root)
        except OSError as error:
            log.warning("no shared memory for the arrays (%s): the pipe carries them", error)
            return None
        return cls(Path(made))

    def write(self, data: memoryview) -> str | None:
        """Put `data` in a new file and return its path; None if it could not be written, or
        if the window is MAX_WAITING_FILES behind."""
        path = self.path / str(next(self._names))
        try:
            if len(os.listdir(self.path)) >= MAX_WAITING_FILES:
                return None
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            view = data.cast("B")
            while view:  # os.write releases the interpreter lock while it copies
                view = view[os.write(fd, view) :]
        except OSError as error:
            log.warning("could not share %d bytes (%s): the pipe carries them", data.nbytes, error)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        finally:
            os.close(fd)
        return str(path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def take(path: str) -> memoryview:
    """The bytes `SharedFolder.write` left at `path`, mapped read-only; the file is unlinked, so
    the memory goes back to the system once the last array over it is gone."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
    finally:
        os.close(fd)
        os.unlink(path)
    return memoryview(mapped)


def remove_stale(root: Path = SHARED_ROOT) -> None:
    """Remove the folders of window processes that are gone (killed before they could)."""
    for folder in root.glob(f"{PREFIX}*-*"):
        owner = folder.name[len(PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not psutil.pid_exists(int(owner)):
            shutil.rmtree(folder, ignore_errors=True)
