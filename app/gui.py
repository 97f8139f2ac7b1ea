"""`glassbox` with no subcommand: the chat window, loading the chosen model in the background."""

from __future__ import annotations

import argparse
import os
import sys

from engine.settings import LoadRequest

NO_DISPLAY = "no display found: set DISPLAY, or run `glassbox chat` for the terminal"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="glassbox", description="Chat with a local model.")
    parser.add_argument(
        "--model", default="bundled", help="'bundled', a hub id, a folder or a .gguf file"
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1 or mps")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16")
    )
    return parser.parse_args(argv)


def display_missing() -> bool:
    """On Linux without X11, Wayland or an explicit Qt platform, Qt would abort."""
    if not sys.platform.startswith("linux"):
        return False
    return not any(os.environ.get(v) for v in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM"))


def run_gui(argv: list[str] | None = None) -> int:
    """Open the window and load the model; returns the process exit code."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if display_missing():
        print(NO_DISPLAY, file=sys.stderr)
        return 2

    from PySide6.QtWidgets import QApplication

    from app.assembly import assemble
    from app.logs import setup_logging

    setup_logging()
    app = QApplication.instance() or QApplication(["glassbox"])
    app.setOrganizationName("Glassbox")
    app.setApplicationName("Glassbox")
    parts = assemble()
    app.aboutToQuit.connect(parts.shutdown)  # however the loop ends, no thread outlives it
    parts.window.show()
    parts.window.load_model(LoadRequest(spec=args.model, device=args.device, dtype=args.dtype))
    code = app.exec()
    parts.window.close()
    parts.shutdown()
    return code
