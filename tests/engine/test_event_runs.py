"""token_runs: a batch of events as its runs of tokens and the events between them."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from engine.events import Failed, Finished, Token, token_runs


def _token(index: int, attention: bool = False) -> Token:
    token = Token(
        index=index, token_id=index, text=f"t{index}", piece=f"t{index}", seconds=0.01,
        kv_bytes=0, kv_bytes_per_layer=(),
    )  # fmt: skip
    return replace(token, attention={0: np.ones((1, index + 1))}) if attention else token


def test_runs_keep_the_order_and_split_at_every_other_event():
    a, b, c, d = (_token(i) for i in range(4))
    end = Finished("stop", "", 1, 0, 4, 0.0, 0.0, 0.0, 0.0, 0.0)
    failed = Failed("x", "RuntimeError")
    assert list(token_runs([a, b, failed, c, d, end])) == [[a, b], failed, [c, d], end]
    assert list(token_runs([end, a])) == [end, [a]]
    assert list(token_runs([])) == []


def test_a_token_the_run_does_not_take_stands_alone():
    a, b, c = _token(0), _token(1, attention=True), _token(2)
    runs = list(token_runs([a, b, c], lambda token: not token.attention))
    assert runs == [[a], b, [c]]
