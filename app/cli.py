"""The `glassbox` command: the window (default), and the subcommands `chat`, `bench`, `peaks`,
`models` (fetch the real test models) and `serve` (an OpenAI-compatible HTTP API).

One parser (app.options): the model options (--model, --device, --dtype, --precision) are
defined once and shared by the window and every subcommand, so `glassbox --help` lists the
subcommands and each `glassbox <command> --help` its own options.
"""

from __future__ import annotations

import argparse
import sys

from app.bench.command import run_bench
from app.model_fetch import run_models
from app.options import parser, print_json
from app.window.gui import run_gui

COMMANDS = ("chat", "bench", "peaks", "models", "serve")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    if args.command == "chat":
        # The terminal chat runs the engine in this process: torch is imported for it alone,
        # never for the window.
        from app.terminal import run_chat

        return run_chat(args)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "peaks":
        return run_peaks(args)
    if args.command == "models":
        return run_models(args)
    if args.command == "serve":
        # Headless: the engine in this process, as the terminal chat runs it, and no Qt.
        from app.api.serve import run_serve

        return run_serve(args)
    return run_gui(argv)


def run_peaks(args: argparse.Namespace) -> int:
    """Print the cached peaks for --device/--dtype, measuring them if there are none."""
    from engine.measure.device import pick_device, pick_dtype
    from engine.measure.peaks import machine_peaks
    from engine.serialize import plain

    try:
        device = pick_device(args.device)
        # auto: the dtype the default model computes in (the bundled model's fast path: bf16)
        dtype = "bfloat16" if args.dtype == "auto" and device.type == "cpu" else args.dtype
        peaks = machine_peaks(device, pick_dtype(device, dtype), args.refresh, args.quick)
    except (ValueError, RuntimeError) as error:
        print(f"glassbox peaks: {error}", file=sys.stderr)
        return 2
    if args.json:
        print_json({**plain(peaks), "ridge_flops_per_byte": peaks.ridge})
    else:
        print(
            f"{peaks.peak_flops_per_s / 1e9:,.1f} GFLOP/s ({peaks.dtype}),"
            f" {peaks.peak_bytes_per_s / 1e9:,.1f} GB/s: compute-bound above"
            f" {peaks.ridge:,.1f} FLOP/byte\n{peaks.method}"
        )
    return 0


__all__ = ["main"]
