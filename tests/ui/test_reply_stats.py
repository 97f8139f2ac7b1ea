"""A reply's numbers in words: one line for the chat, the status bar, the terminal and exports."""

from __future__ import annotations

from app.bench.synthetic import SyntheticSession, model_info
from engine.events import Tally
from engine.settings import Message
from ui.reply_stats import finished_stats, prefill_line, speed_line, stats_line


def test_a_finished_reply_reads_the_same_from_its_event_and_from_the_store():
    session = SyntheticSession(model_info(layers=2), ("a", " b", " c"), step_s=0.1)
    prefill, *_, finished = session.generate([Message("user", "one two three")])
    stats = finished_stats(finished)
    assert "text" not in stats and stats["finish_reason"] == "eos"
    # 6 prompt tokens; TTFT = 1 ms tokenizing + 2 steps; two more steps of 0.1 s: 10 tok/s.
    assert stats_line(stats) == "6-token prompt · 3 tokens · TTFT 0.20 s · 10.0 tok/s"
    assert speed_line(stats) == "TTFT 0.20 s · 10.0 tok/s"
    assert prefill_line(prefill) == "Prefill: 6 tokens in 0.10 s (60 tok/s)"


def test_why_a_reply_ended_is_said_unless_it_simply_ended():
    tally = Tally(started=0.0, prompt_tokens=40, reused_tokens=30, generated=1, ttft_s=0.05)
    line = stats_line(finished_stats(tally.finished("cancelled", "x")))
    assert line == "40-token prompt (30 reused) · 1 token · TTFT 0.05 s · stopped"
    assert stats_line(finished_stats(tally.finished("context_full", ""))).endswith("context full")
