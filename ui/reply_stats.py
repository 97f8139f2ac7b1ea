"""A reply's numbers in words, the same wherever they are shown: under the reply in the chat,
in the status bar, after a reply in the terminal and in a Markdown export.

Qt-free (an import contract keeps it so): the terminal and the exports use it without widgets.
The numbers are read from the mapping the store keeps for a reply (`finished_stats`: the
fields of `Finished` under the names of `glassbox chat --json`); what is missing is left out,
so conversations stored by older versions still read well.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.events import Finished, PrefillDone
from engine.serialize import event_to_dict

Stats = Mapping[str, Any]

# Why a reply ended, as the line says it; a reply that simply ended says nothing.
ENDINGS = {
    "eos": "",
    "stop_string": "stop string",
    "length": "length limit",
    "cancelled": "stopped",
    "error": "error",
    "context_full": "context full",
}


def finished_stats(finished: Finished) -> dict[str, Any]:
    """The numbers of a finished reply, as the store keeps them (its text is the message)."""
    stats = event_to_dict(finished)
    del stats["event"], stats["text"]
    return stats


def _count(n: int, unit: str) -> str:
    return f"{n} {unit}" if n == 1 else f"{n} {unit}s"


def speed_line(stats: Stats) -> str:
    """Time to first token and decode speed, e.g. "TTFT 0.25 s · 20.0 tok/s"."""
    parts = []
    if "ttft_s" in stats:
        parts.append(f"TTFT {stats['ttft_s']:.2f} s")
    if stats.get("decode_tokens_per_s"):
        parts.append(f"{stats['decode_tokens_per_s']:.1f} tok/s")
    return " · ".join(parts)


def stats_line(stats: Stats) -> str:
    """E.g. "42-token prompt (30 reused) · 21 tokens · TTFT 0.12 s · 20.0 tok/s · stopped"."""
    parts: list[str] = []
    if "prompt_tokens" in stats:
        reused = stats.get("reused_tokens", 0)
        parts.append(
            f"{stats['prompt_tokens']}-token prompt" + (f" ({reused} reused)" * bool(reused))
        )
    if "generated_tokens" in stats:
        parts.append(_count(stats["generated_tokens"], "token"))
    parts.append(speed_line(stats))
    parts.append(ENDINGS.get(stats.get("finish_reason", ""), ""))
    return " · ".join(part for part in parts if part)


def prefill_line(event: PrefillDone) -> str:
    """The prompt's pass, e.g. "Prefill: 12 tokens in 0.05 s (240 tok/s)"."""
    reused = f" ({event.reused_tokens} reused from the cache)" if event.reused_tokens else ""
    return (
        f"Prefill: {event.processed_tokens} tokens in {event.seconds:.2f} s"
        f" ({event.tokens_per_s:.0f} tok/s){reused}"
    )
