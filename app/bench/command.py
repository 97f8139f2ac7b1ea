"""`glassbox bench`: decode speed in exact and fast precision against model.generate (and
llama.cpp when installed), with the live view on vs off, prefill and a long context; and
with --gui (or --gui-only) how long the window's event loop stalls while a long reply streams;
with --window only, what the real window costs the model it shows (app.bench.window)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from app.options import load_request, print_json

if TYPE_CHECKING:
    from engine.load.loader import LoadedModel
    from engine.settings import LoadRequest


def run_bench(args: argparse.Namespace) -> int:
    results: dict[str, Any] = {}
    speed_only = not (args.window or args.stepping or args.placement or args.gui_only)
    if args.device.startswith("cuda") and speed_only:
        return cuda_bench(args)
    if not shape_resolved(args):
        return 1
    if args.window:
        return _finish(args, {"window": window_cost(args), "transport": transport_cost()})
    if args.stepping:
        return _finish(args, {"stepping": stepping_cost(args)})
    if args.placement:
        return placement_cost(args)
    if not args.gui_only:
        from app.bench import speed as benchmark
        from engine.load.loader import ModelLoadError, resolve

        try:
            exact, fast = load_both(load_request(args), with_exact=not args.fast_only)
        except ModelLoadError as error:
            print(f"glassbox bench: {error}", file=sys.stderr)
            return 1
        gguf = resolve(args.model)[1] if fast is not None else None
        results = benchmark.run(
            exact, new_tokens=args.new_tokens, repeats=args.repeats, fast=fast, gguf_path=gguf
        )
    if args.gui or args.gui_only:
        results["gui"] = gui_stall(
            args.gui_tokens, args.gui_rate, args.gui_pipe, args.gui_rows_per_token
        )
    return _finish(args, results)


def cuda_bench(args: argparse.Namespace) -> int:
    """The fast engine's static step against generate's dynamic and static caches on CUDA
    (app.bench.gpu); one line and exit status 2 where there is no CUDA device."""
    from app.bench import gpu as gpu_benchmark
    from engine.load.loader import ModelLoadError, load_model

    missing = gpu_benchmark.cuda_missing()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    if not shape_resolved(args):  # after the check: Qwen's shape is 1.1 GB to write
        return 1
    # the load's stages, the compile and each bucket's recording, with their times (stderr)
    logging.basicConfig(
        level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s"
    )
    request = replace(load_request(args), precision="auto")
    try:
        started = time.perf_counter()
        exact = None if args.fast_only else load_model(replace(request, precision="exact"))
        exact_s = time.perf_counter() - started
        fast = load_model(replace(request, precision="fast"))
        fast_s = time.perf_counter() - started - exact_s
        int4, int4_s = int4_form(replace(request, precision="fast")) if args.int4 else (None, 0)
    except ModelLoadError as error:
        print(f"glassbox bench: {error}", file=sys.stderr)
        return 1
    results = gpu_benchmark.run(
        fast, exact, new_tokens=args.new_tokens, repeats=args.repeats, int4=int4
    )
    results["shape"] = args.shape
    results["load_s"] = {"fast": fast_s} | ({} if exact is None else {"exact": exact_s})
    if int4 is not None:
        results["load_s"]["fast_int4"] = int4_s
    if args.gui:
        results["gui"] = gui_stall(args.gui_tokens, args.gui_rate)
    args.json = True  # its own shape: printed as JSON
    return _finish(args, results)


def int4_form(request: LoadRequest) -> tuple[LoadedModel, float]:
    """The fast model again with CUDA's int4 kernel where its weights fit it (to_device's
    GLASSBOX_CUDA_INT4=1), and its load time."""
    from engine.load.loader import load_model

    before = os.environ.get("GLASSBOX_CUDA_INT4")
    os.environ["GLASSBOX_CUDA_INT4"] = "1"
    try:
        started = time.perf_counter()
        return load_model(request), time.perf_counter() - started
    finally:
        if before is None:
            os.environ.pop("GLASSBOX_CUDA_INT4", None)
        else:
            os.environ["GLASSBOX_CUDA_INT4"] = before


def shape_resolved(args: argparse.Namespace) -> bool:
    """Resolve --model shape:NAME (recorded as args.shape); False, said why, for an unknown one."""
    try:
        args.shape = model_shape(args)
    except ValueError as error:
        print(f"glassbox bench: {error}", file=sys.stderr)
        return False
    return True


def model_shape(args: argparse.Namespace) -> str | None:
    """For --model shape:NAME, write (once) the random-weight GGUF of that layout
    (app/bench/shapes.py) and point --model at it; the shape's name, or None."""
    from app.bench import shapes

    shape = shapes.shape_named(args.model)
    if shape is None:
        return None
    args.model = str(shapes.shape_file(shape))
    return shape.name


def placement_cost(args: argparse.Namespace) -> int:
    """The model placed as asked against it in memory (app/bench/placement.py); with
    --fast-only (a model that does not fit in memory) or --evict, placed alone."""
    from app.bench import placement as benchmark
    from engine.load.loader import ModelLoadError, load_model

    request = load_request(args)
    if not request.placed:
        print("glassbox bench --placement: give --max-memory or --device-map", file=sys.stderr)
        return 1
    try:
        placed = load_model(replace(request, compiled=False))
        unplaced = replace(request, device_map="", max_memory="")
        # --evict: alone, as another model of the file would hold pages the OS cannot drop
        in_memory = None if args.fast_only or args.evict else load_model(unplaced)
        results = benchmark.run(placed, in_memory, args.new_tokens, args.repeats, args.evict)
    except (ModelLoadError, ValueError) as error:
        print(f"glassbox bench: {error}", file=sys.stderr)
        return 1
    return _finish(args, {"placement": results})


def load_both(
    request: LoadRequest, with_exact: bool = True
) -> tuple[LoadedModel | None, LoadedModel | None]:
    """The exact model (what generate runs) and, for a GGUF it can run, the fast one; without
    `with_exact`, the fast one alone (a model too large or slow to run in float32 beside it)."""
    from engine.load.loader import ModelLoadError, load_model

    if not with_exact:
        return None, load_model(replace(request, precision="fast"))
    exact = load_model(replace(request, precision="exact"))
    if request.precision == "exact":
        return exact, None
    try:
        return exact, load_model(replace(request, precision="fast"))
    except ModelLoadError:
        if request.precision == "fast":
            raise
        return exact, None  # auto: a model without a fast path is measured exact only


def _finish(args: argparse.Namespace, results: dict[str, Any]) -> int:
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    if args.json:
        print_json(results)
    else:
        print_text(results)
    return 0


def gui_stall(
    tokens: int, rate: float = 0.0, pipe: bool = False, rows_per_token: bool = False
) -> dict[str, Any]:
    # Drawn offscreen unless told otherwise: no window pops up, and no display is needed.
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.bench.stall import measure_gui_stall

    return measure_gui_stall(tokens, tokens_per_s=rate, pipe=pipe, rows_per_token=rows_per_token)


def window_cost(args: argparse.Namespace) -> dict[str, Any]:
    """The real window on the engine process vs the same engine headless (app.bench.window)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.server.engine_process import EngineProcess

    engine = EngineProcess()  # first, as `glassbox` does: the warm start is timed from launch
    from app.bench.window import measure_window

    request = load_request(args)
    return measure_window(
        request,
        new_tokens=args.new_tokens,
        repeats=args.repeats,
        engine=engine,
        layout=args.window_layout,
    )


def stepping_cost(args: argparse.Namespace) -> dict[str, Any]:
    """Next token's latency in the real window and a held reply's CPU (app.bench.stepping)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.server.engine_process import EngineProcess

    engine = EngineProcess()  # before Qt, as `glassbox` starts it
    from app.bench.stepping import measure_stepping

    return measure_stepping(load_request(args), engine, presses=args.repeats * 2)


def transport_cost() -> dict[str, Any]:
    """Bytes/s and latency of the engine-to-window channel at 10,000 keys (app.bench.window)."""
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from app.bench.transport import measure_transport

    return measure_transport()


def print_text(results: dict[str, Any]) -> None:
    if "decode_tokens_per_s" in results:
        print(f"{results['model']} on {results['device']} ({results['dtype']})")
        for name, rate in results["decode_tokens_per_s"].items():
            print(f"  {name:16} {rate:8.1f} tokens/s")
        if "ratio_engine_vs_generate" in results:
            print(f"  engine / generate  {results['ratio_engine_vs_generate']:.3f}")
            print(f"  live view cost     {results['view_cost']:+.1%}")
        print(f"  sampling cost      {results['sampling_cost']:+.1%}")
        if "compiled_decode" in results:
            if "ratio_fast_vs_exact" in results:
                print(f"  fast / exact       {results['ratio_fast_vs_exact']:.2f}")
            print(f"  decode step        {results['compiled_decode']['decode_step']}")
            if "ratio_compiled_vs_eager" in results:
                print(f"  compiled / eager   {results['ratio_compiled_vs_eager']:.2f}")
            prefill, long = results["prefill"], results["long_context"]
            for name, rate in prefill["tokens_per_s"].items():
                print(f"  prefill {name:10} {rate:8.1f} tokens/s ({prefill['tokens']} tokens)")
            time_ratio, bytes_ratio = long["time_ratio"], long["bytes_ratio"]
            context = long["long"]["context"]
            print(f"  at {context} tokens  {time_ratio:.2f}x time, {bytes_ratio:.2f}x bytes")
        if "ratio_fast_vs_llama_cpp" in results:
            print(f"  fast / llama.cpp   {results['ratio_fast_vs_llama_cpp']:.2f}")
        if "ratio_fast_vs_llama_cpp" in results.get("prefill", {}):
            print(f"  prefill fast/llama {results['prefill']['ratio_fast_vs_llama_cpp']:.2f}")
        if "llama_cpp" in results:
            print(f"  llama.cpp          {results['llama_cpp']}")
        print(f"  peak RSS           {results['peak_rss_mb']:.0f} MB")
    placement = results.get("placement")
    if placement:
        _print_placement(placement)
    window = results.get("window")
    if window:
        print(
            f"{window['model']}: window ({window['layout']} panels) vs headless,"
            f" {window['prompt_tokens']}-token prompt"
        )
        print(f"  decode tokens/s    {window['decode_tokens_per_s']}")
        print(f"  decode ratio       {window['decode_ratio_window_vs_headless']}")
        print(
            f"  paired, 90% range  {window['decode_ratio_paired_median']}"
            f" {window['decode_ratio_paired_ci90']}"
        )
        print(f"  over wall time     {window['decode_wall_ratio_paired_median']} (paired)")
        print(f"  vs the terminal's  {window['decode_ratio_window_vs_terminal']}")
        print(f"  TTFT s             {window['ttft_s']}")
        print(f"  GUI CPU per second {window['gui_cpu_per_s']}")
        print(f"  idle window        {window['gui_cpu_idle_per_s']}")
        print(f"  window process CPU {window['window_process_cpu_per_s']}")
        for side, threads in window["wakeups_per_s"].items():
            woken = ", ".join(f"{name} {rate['wakeups']:g}" for name, rate in threads.items())
            print(f"  {side + ' wake-ups/s':18} {woken}")
        print(f"  engine preempted/s {window['engine_preempted_per_s']}")
        print(f"  stall ms           {window['stall_ms']}")
        print(f"  start s            {window['start_s']}")
    stepping = results.get("stepping")
    if stepping:
        print(f"{stepping['model']}: Next token, {stepping['presses']} presses (ms)")
        for key in ("next_token_ms", "engine_step_ms", "window_share_ms", "select_step_ms"):
            print(f"  {key:18} {stepping[key]}")
        print(f"  held               {stepping['held']}")
    gui = results.get("gui")
    if gui:
        print(f"window, {gui['tokens']:,}-token reply ({gui['source']})")
        print(f"  longest stall      {gui['longest_stall_ms']:8.1f} ms")
        print(f"  99th percentile    {gui['p99_stall_ms']:8.1f} ms")
        print(f"  redraws            {gui['redraws']:8d}")
        print(f"  streamed in        {gui['seconds']:8.1f} s")
        costly = sorted(gui["redraw_cpu_ms_per_panel"].items(), key=lambda item: -item[1])
        print("  redraw CPU (ms)    " + ", ".join(f"{name} {ms:g}" for name, ms in costly))


def _print_placement(report: dict[str, Any]) -> None:
    places = ", ".join(f"{p} {b / 1e6:.0f} MB" for p, b in report["place_bytes"].items())
    print(f"{report['model']} ({report['precision']}), {report['note']}: {places}")
    for name, rate in report["decode_tokens_per_s"].items():
        print(f"  {name:16} {rate:8.2f} tokens/s")
    if "ratio_placed_vs_in_memory" in report:
        print(f"  placed / in memory {report['ratio_placed_vs_in_memory']:.2f}")
    if "ratio_placed_vs_in_memory_eager" in report:
        print(f"  placed / eager     {report['ratio_placed_vs_in_memory_eager']:.2f}")
    for key in ("step_vs_predicted", "transfer_vs_predicted", "bytes_read_vs_moved"):
        value = report[key]
        print(f"  {key:22} {'-' if value is None else f'{value:.2f}'}")
