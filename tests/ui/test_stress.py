"""A 10,000-token reply into the whole window, internals docks floating: it stays responsive and
nothing is lost on the way (app.bench.stall streams synthetic events with the bundled model's
shapes).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from app.bench.stall import SOURCE, StallRun, stall_statistics
from ui.conversation import Change, ReplyTokens
from ui.panels.docks import DOCKS
from ui.panels.pooled_rows import DISPLAY_KEYS, DISPLAY_ROWS

TOKENS = 10_000
# Measured here (2 cores, offscreen): longest stall 100-125 ms, 99th percentile about 100 ms:
# at 10,000 keys one frame (four panels, nine heatmaps re-pooled) takes that long. Before the
# worker bounded its deliveries and the attention rows stopped being reallocated, the longest
# stall was 0.9-1.7 s. 500 ms leaves a shared CI machine 4x headroom and still catches those.
MAX_STALL_MS = 500
# The 99th percentile: 159 ms measured with the machine's load at 7 on its 2 cores.
MAX_P99_STALL_MS = 300


@pytest.fixture
def run(qtbot, tmp_path):
    # Every token carries its rows (the heavier contract, still served): the attention panel
    # then keeps and drops rows as it did before the view pulled only the latest.
    stall_run = StallRun(tmp_path, rows_per_token=True)
    qtbot.addWidget(stall_run.window)
    yield stall_run
    stall_run.close()


def test_stall_statistics_are_the_gaps_beyond_the_interval():
    beats = [0.0, 0.005, 0.010, 0.050, 0.055]
    longest, p99 = stall_statistics(beats, 0.005)
    assert math.isclose(longest, 0.035)
    # Stalls [0, 0, 0.035, 0]: the 99th percentile lies 97% of the way from 0 to 0.035.
    assert math.isclose(p99, 0.97 * 0.035)
    assert stall_statistics([1.0], 0.005) == (0.0, 0.0)


def test_ten_thousand_tokens_keep_the_window_responsive_and_reach_every_panel(run):
    streamed: list[str] = []

    def record(change: Change) -> None:
        if isinstance(change, ReplyTokens):
            streamed.extend(token.text for token in change.tokens)

    run.window.conversation_model.subscribe(record)
    result = run.stream(TOKENS)
    print(f"\n{result}")

    assert result["source"] == SOURCE and result["tokens"] == TOKENS
    assert result["longest_stall_ms"] < MAX_STALL_MS
    assert result["p99_stall_ms"] < MAX_P99_STALL_MS
    # Every panel floats and is on screen: each redrew, and its redraws' CPU is counted. The
    # four that draw every token kept redrawing while the reply streamed.
    redrawn, cpu_ms = result["redraws_per_panel"], result["redraw_cpu_ms_per_panel"]
    assert sum(redrawn[name] for name in ("timing", "kv_cache", "attention", "next_token")) > 4 * 10
    assert set(cpu_ms) == set(redrawn) == {name for _object, _title, name in DOCKS}
    assert all(redrawn[name] > 0 and cpu_ms[name] >= 0 for name in redrawn)
    assert cpu_ms["attention"] > 0  # its mosaic pooled 10,000 tokens' rows

    # Every token's text reached the conversation, in order, and the finished reply is that
    # text, drawn in the chat.
    text = "".join(run.session.token_texts)
    assert len(run.session.token_texts) == TOKENS
    assert "".join(streamed) == text
    assert run.window.conversation()[-1].content == text
    shown = run.window.chat.toPlainText()
    tail = " ".join(text.rstrip().splitlines()[-1].split()[-5:])  # within the last paragraph
    assert shown.rindex(tail) < shown.index(f"{TOKENS} tokens · TTFT")  # then its stats line

    # The KV curve ends at the last event's bytes, one point per cache length in the state
    # (the curve draws about two per pixel of them).
    tokens, kv_bytes = run.internals.kv_cache.curve.getData()
    assert kv_bytes[-1] == run.session.last_kv_bytes
    state = run.internals.state
    assert tokens[-1] == state.kv_tokens.last()
    assert len(state.kv_tokens) == TOKENS + 1  # empty, the prompt (token 0 reads it), one per later

    # The heatmap is still exactly the max-pool of the rows kept, which stay bounded.
    panel = run.internals.attention
    rows = run.internals.state.attention[panel.selected_layer]
    assert rows.rows <= DISPLAY_ROWS and rows.dropped > 0
    assert rows.positions[-1] == rows.keys - 1
    image = np.stack([panel.head_tile(head) for head in panel.slots])  # the mosaic's tiles
    row_factor, key_factor = panel.pool_factors  # about one cell per pixel of the tile
    assert row_factor >= math.ceil(rows.rows / DISPLAY_ROWS)
    assert key_factor >= math.ceil(rows.keys / DISPLAY_KEYS)
    _heads, blocks, columns = image.shape
    dense = rows.padded(0, columns * key_factor)
    full = np.zeros((rows.heads, blocks * row_factor, columns * key_factor), dtype=np.float32)
    full[:, : rows.rows] = dense
    pooled = full.reshape(rows.heads, blocks, row_factor, columns, key_factor).max(axis=(2, 4))
    np.testing.assert_allclose(image, pooled, rtol=1e-6)  # colour scale undone: float32


def test_bench_gui_only_reports_the_window_numbers_without_a_model(qapp, capsys):
    from app.cli import main

    assert main(["bench", "--gui-only", "--gui-tokens", "200", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report) == {"gui"}  # no model was loaded or measured
    gui = report["gui"]
    assert gui["source"] == SOURCE and gui["tokens"] == 200
    # Its shape, not its speed (the 10,000-token test above guards the stalls): a 200-token
    # run is mostly the window's first paint, which a loaded CI machine stretched past 500 ms.
    assert 0 <= gui["p99_stall_ms"] <= gui["longest_stall_ms"]
    assert gui["redraws"] > 0
    # Both figures are rounded (seconds to the millisecond): the rate must lie between the rates
    # of the slowest and fastest run that rounds to the reported time.
    slowest, fastest = gui["seconds"] + 0.0005, max(gui["seconds"] - 0.0005, 1e-6)
    assert 200 / slowest - 0.05 <= gui["tokens_per_s"] <= 200 / fastest + 0.05


def test_a_stall_is_split_into_the_gui_threads_own_time_and_waiting():
    """bench --window's stall_own_cpu_ms: of each gap between heartbeats beyond the interval,
    the part the GUI thread ran (its CPU time in the gap, never more than the stall)."""
    from app.bench.measures import WindowReply, own_stalls

    reply = WindowReply(sent=0.0)
    # Beats at 0, 5 ms (on time), 45 ms (a 35 ms stall, 30 ms of it the GUI's own work),
    # 95 ms (a 45 ms stall the thread spent waiting: 1 ms of CPU).
    reply.beats = [0.0, 0.005, 0.045, 0.095]
    reply.beat_cpu = [0.0, 0.0005, 0.0305, 0.0315]
    np.testing.assert_allclose(own_stalls(reply, 0.005), [0.0, 0.030, 0.001], atol=1e-12)
    reply.beat_cpu = [0.0, 0.004, 0.050, 0.100]  # more CPU than the stall: capped at it
    np.testing.assert_allclose(own_stalls(reply, 0.005), [0.0, 0.035, 0.045], atol=1e-12)
