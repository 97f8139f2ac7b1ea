"""`glassbox` with no subcommand: the chat window, loading the chosen model in the background.

The engine process is spawned first, before Qt is even imported, so that torch and the model
load in it while this process builds the window (which never imports torch)."""

from __future__ import annotations

import argparse
import ctypes.util
import gc
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from app import collector
from app.options import load_request, parser

if TYPE_CHECKING:
    from app.client.engine_client import EngineClient
    from app.server.engine_process import EngineProcess
    from app.window.assembly import Parts

NO_DISPLAY = "no display found: set DISPLAY, or run `glassbox chat` for the terminal"
X11_PACKAGES = (
    "Debian/Ubuntu: sudo apt-get install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1"
    " libxcb-shape0 libxkbcommon-x11-0"
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The window's options: the same --model/--device/--dtype/--precision as every command."""
    return parser().parse_args(argv)


def display_missing() -> bool:
    """On Linux without X11, Wayland or an explicit Qt platform, Qt would abort."""
    if not sys.platform.startswith("linux"):
        return False
    return not any(os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def x11_problem() -> str | None:
    """Why Qt could not open an X11 window, asked before Qt aborts the process over it."""
    uses_x11 = os.environ.get("QT_QPA_PLATFORM", "xcb") == "xcb" and os.environ.get("DISPLAY")
    if not sys.platform.startswith("linux") or not uses_x11 or os.environ.get("WAYLAND_DISPLAY"):
        return None
    import PySide6

    qt_x11 = Path(PySide6.__file__).parent / "Qt" / "lib" / "libQt6XcbQpa.so.6"
    missing = None if ctypes.util.find_library("xcb-cursor") else "libxcb-cursor.so.0"
    try:
        ctypes.CDLL(str(qt_x11))
    except OSError as error:  # e.g. "libxcb-icccm.so.4: cannot open shared object file"
        missing = str(error).split(":")[0].strip()
    if missing is None:
        return None
    return (
        f"Qt cannot open an X11 window: the system library {missing} is missing"
        f" ({X11_PACKAGES}). Or run `glassbox chat` for the terminal."
    )


def spawn_engine() -> EngineProcess:
    """Start the engine process now (Qt-free); see app.server.engine_process."""
    from app.server.engine_process import EngineProcess

    return EngineProcess()


def engine_backend(engine: EngineProcess) -> EngineClient:
    """The window's backend on the engine process spawned by `spawn_engine` (Qt: imported
    once the engine is on its way)."""
    from app.client.engine_client import EngineClient

    return EngineClient(engine)


def open_window(engine: EngineProcess, **options: Any) -> Parts:
    """Import Qt, build the window on `engine` and show it; `options` go to `assemble`.

    The collector is paused meanwhile, and what the imports made is frozen out of its reach:
    see app.collector."""
    with collector.paused():
        from PySide6.QtWidgets import QApplication

        from app.window.assembly import assemble

        backend = engine_backend(engine)
        gc.freeze()
        app = QApplication.instance() or QApplication(["glassbox"])
        app.setOrganizationName("Glassbox")
        app.setApplicationName("Glassbox")
        parts = assemble(backend, **options)
        parts.window.show()
    return parts


def run_gui(argv: list[str] | None = None) -> int:
    """Open the window and load the model; returns the process exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if display_missing():
        print(NO_DISPLAY, file=sys.stderr)
        return 2
    problem = x11_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 2

    engine = spawn_engine()
    from app.logs import setup_logging

    setup_logging()
    parts = open_window(engine)
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance()
    assert app is not None  # made by open_window
    app.aboutToQuit.connect(parts.shutdown)  # however the loop ends, no thread outlives it
    from app.window.quit_signals import CloseOnSignals

    CloseOnSignals(parts.window)  # a logout's SIGTERM or Ctrl+C closes it as its button does
    parts.window.load_model(load_request(args))
    code = app.exec()
    parts.window.close()
    parts.shutdown()
    return code
