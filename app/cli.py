"""The `glassbox` command: the window (default), `glassbox chat` and `glassbox bench`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.settings import PRECISIONS, GenerationSettings, LoadRequest, SettingsError


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "chat":
        from app.terminal import run_chat

        return run_chat(chat_parser().parse_args(argv[1:]))
    if argv and argv[0] == "bench":
        from app.bench import run_bench

        return run_bench(bench_parser().parse_args(argv[1:]))
    from app.gui import run_gui

    return run_gui(argv)


def add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="bundled", help="bundled, a hub id, a folder or a .gguf")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument(
        "--precision",
        default="auto",
        choices=PRECISIONS,
        help="exact: dequantised weights (the reference); fast: a GGUF's own 4/8-bit weights;"
        " auto: fast where it can run (default)",
    )


def load_request(args: argparse.Namespace) -> LoadRequest:
    return LoadRequest(
        spec=args.model, device=args.device, dtype=args.dtype, precision=args.precision
    )


def chat_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glassbox chat", description="Chat in the terminal.")
    add_model_options(parser)
    parser.add_argument("--prompt", help="answer this one message and exit")
    parser.add_argument("--system", default="", help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--greedy", action="store_true", help="always pick the likeliest token")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-cache", action="store_true", help="teaching mode: no KV cache")
    parser.add_argument("--json", action="store_true", help="one JSON object per event per line")
    parser.add_argument(
        "--no-store", action="store_true", help="do not keep this chat with the conversations"
    )
    parser.add_argument("--trace", type=Path, help="write the reply's internals as JSON here")
    parser.add_argument(
        "--watch-layers", default="0", help="layers whose attention --trace records: all, 0,14,29"
    )
    return parser


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
    )


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glassbox bench", description="Measure decode speed.")
    add_model_options(parser)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--output", type=Path, help="also write the JSON here")
    parser.add_argument(
        "--gui", action="store_true", help="also measure how long the window stalls on a long reply"
    )
    parser.add_argument("--gui-only", action="store_true", help="only the window's stall")
    parser.add_argument(
        "--gui-tokens", type=int, default=10_000, help="length of that reply (default 10000)"
    )
    parser.add_argument(
        "--window", action="store_true", help="only the real window vs headless, real model"
    )
    return parser


def print_json(data: object) -> None:
    print(json.dumps(data, ensure_ascii=False), flush=True)


__all__ = ["SettingsError", "main"]
