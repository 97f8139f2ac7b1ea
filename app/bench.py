"""`glassbox bench`: decode speed against model.generate and with the live view on vs off."""

from __future__ import annotations

import argparse
import json
import sys

from app.cli import load_request, print_json
from engine import benchmark
from engine.loader import ModelLoadError, load_model


def run_bench(args: argparse.Namespace) -> int:
    try:
        loaded = load_model(load_request(args))
    except ModelLoadError as error:
        print(f"glassbox bench: {error}", file=sys.stderr)
        return 1
    results = benchmark.run(loaded, new_tokens=args.new_tokens, repeats=args.repeats)
    if args.output:
        args.output.write_text(json.dumps(results, indent=2))
    if args.json:
        print_json(results)
    else:
        rates = results["decode_tokens_per_s"]
        print(f"{results['model']} on {results['device']} ({results['dtype']})")
        for name, rate in rates.items():
            print(f"  {name:16} {rate:8.1f} tokens/s")
        print(f"  engine / generate  {results['ratio_engine_vs_generate']:.3f}")
        print(f"  live view cost     {results['view_cost']:+.1%}")
    return 0
