"""What one frame of each internals panel costs at a given context length (a timing harness,
not a test: machines are noisy, so it reports numbers instead of asserting them).

    QT_QPA_PLATFORM=offscreen python -m tests.ui.frame_cost --keys 1000 10000 [--json]

The panels float at 720 x 460 as in `glassbox bench --gui`, fed by the synthetic session (the
bundled model's shapes, four watched layers); its events get roofline figures of the bundled
model's order (the session counts none) so the roofline panel draws its cloud too. Up to
`keys` tokens of context are ingested, then each of the next `frames` tokens is one frame, as
when a model streams at 15-30 tokens/s: ingest the token, then per panel redraw() (Python:
setData, pooling, levels) and paint (processing the update requests it queued). CPU time of
the GUI thread, so other processes on the machine do not count; the median and the largest
over the frames.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from typing import Any

from PySide6.QtWidgets import QApplication

from app.bench.synthetic import SyntheticSession
from engine.events import Peaks, PrefillDone, Roofline, Token
from engine.settings import GenerationSettings, Message, ProbeSettings
from ui.panels.docks import InternalsView

LAYERS = (0, 9, 19, 29)  # the bundled model's default watched layers
PANELS = ("timing", "kv_cache", "attention", "next_token", "roofline")


def _ms(seconds: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(seconds) * 1000, 2),
        "max_ms": round(max(seconds) * 1000, 2),
    }


PEAKS = Peaks(4e11, 5e9, "bfloat16", "cpu", "frame-cost stand-in")


def with_roofline(event: Any, position: int) -> Any:
    """The event with a plausible roofline: decode near 3 FLOP/byte, prefill past the ridge."""
    if isinstance(event, PrefillDone):
        flops, moved = 2.7e8 * event.processed_tokens, 1e8
    elif isinstance(event, Token) and event.index > 0:
        flops, moved = 2.7e8 + 1e4 * position, 9e7 + 3e3 * position
    else:
        return event
    counted = Roofline(int(flops), int(moved), flops / moved, flops / 0.05, moved / 0.05, "memory")
    return replace(event, roofline=counted)


def measure(keys: int, frames: int = 30) -> dict[str, Any]:
    """Per panel: redraw and paint CPU time per frame once the context holds `keys` tokens."""
    app = QApplication.instance() or QApplication(["frame-cost"])
    session = SyntheticSession()
    view = InternalsView()
    view.timer.stop()  # frames are driven here, one per token
    for dock in view.docks.values():
        dock.setFloating(True)
        dock.resize(720, 460)
        dock.show()
    view.set_model(replace(session.info, peaks=PEAKS))
    view.set_watched_layers(LAYERS)
    app.processEvents()
    messages = [Message(role="user", content="Explain attention.")]
    settings = GenerationSettings(greedy=True, max_new_tokens=keys + frames)
    probes = ProbeSettings(attention_layers=LAYERS)
    redraw: dict[str, list[float]] = {name: [] for name in PANELS}
    paint: dict[str, list[float]] = {name: [] for name in PANELS}
    ingest: list[float] = []
    prompt = 0
    for event in session.generate(messages, settings, probes):
        if isinstance(event, PrefillDone):
            prompt = event.prompt_tokens
        event = with_roofline(event, prompt + getattr(event, "index", 0))
        started = time.thread_time()
        view.ingest(event)
        if not isinstance(event, Token) or prompt + event.index < keys:
            continue
        ingest.append(time.thread_time() - started)
        for name in PANELS:
            panel = getattr(view, name)
            started = time.thread_time()
            if panel.needs_redraw():  # as the timer asks (the roofline, the timeline and the
                # attention overview redraw once a second)
                panel.redraw()
            drawn = time.thread_time()
            app.processEvents()  # the paint events the redraw queued
            redraw[name].append(drawn - started)
            paint[name].append(time.thread_time() - drawn)
    for dock in view.docks.values():
        dock.close()
    totals = [
        sum(redraw[n][i] + paint[n][i] for n in PANELS) + ingest[i] for i in range(len(ingest))
    ]
    return {
        "keys": keys,
        "frames": len(ingest),
        "ingest_one_token": _ms(ingest),
        "panels": {n: {"redraw": _ms(redraw[n]), "paint": _ms(paint[n])} for n in PANELS},
        "frame_total": _ms(totals),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1000, 10_000])
    parser.add_argument("--frames", type=int, default=30)
    parser.add_argument("--json", action="store_true", help="one JSON line per context length")
    options = parser.parse_args()
    for keys in options.keys:
        result = measure(keys, options.frames)
        if options.json:
            print(json.dumps(result))
            continue
        print(f"{keys:,} keys, {result['frames']} frames (CPU ms per frame, median / max):")
        ingest = result["ingest_one_token"]
        print(f"  ingest one token   {ingest['median_ms']:7.2f} / {ingest['max_ms']:.2f}")
        for name, costs in result["panels"].items():
            redraw, paint = costs["redraw"], costs["paint"]
            print(
                f"  {name:<11} redraw {redraw['median_ms']:7.2f} / {redraw['max_ms']:7.2f}"
                f"   paint {paint['median_ms']:7.2f} / {paint['max_ms']:.2f}"
            )
        total = result["frame_total"]
        print(f"  whole frame        {total['median_ms']:7.2f} / {total['max_ms']:.2f}")


if __name__ == "__main__":
    main()
