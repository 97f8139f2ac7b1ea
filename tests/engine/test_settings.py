"""Settings validation says what is wrong; layer lists parse the forms the CLI and UI accept."""

from __future__ import annotations

import dataclasses

import pytest

from engine.settings import (
    FEWEST_ROWS,
    GenerationSettings,
    LoadRequest,
    Message,
    ProbeSettings,
    SettingsError,
    parse_layers,
    rows_within,
)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"temperature": -1.0}, ["temperature", "-1.0", "greedy"]),
        ({"temperature": 0.0}, ["temperature", "above 0"]),
        ({"top_p": 0.0}, ["top-p", "0.0", "(0, 1]"]),
        ({"top_p": 1.5}, ["top-p", "1.5", "(0, 1]"]),
        ({"top_p": -0.1}, ["top-p", "-0.1"]),
        ({"top_k": -1}, ["top-k", "-1"]),
        ({"max_new_tokens": 0}, ["max new tokens", "at least 1", "0"]),
        ({"max_new_tokens": -5}, ["max new tokens", "-5"]),
        ({"repetition_penalty": 0.0}, ["repetition penalty", "above 0"]),
    ],
)
def test_generation_settings_refuse_out_of_range(kwargs, words):
    with pytest.raises(SettingsError) as caught:
        GenerationSettings(**kwargs)
    message = str(caught.value)
    for word in words:
        assert word in message, f"{word!r} missing from {message!r}"


def test_settings_error_is_a_value_error():
    with pytest.raises(ValueError):
        GenerationSettings(top_k=-3)


def test_greedy_ignores_temperature_but_not_the_rest():
    assert GenerationSettings(greedy=True, temperature=-1.0).greedy
    assert GenerationSettings(greedy=True, temperature=0.0).greedy
    with pytest.raises(SettingsError, match="max new tokens"):
        GenerationSettings(greedy=True, max_new_tokens=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"top_p": 1.0, "top_k": 0},
        {"temperature": 1e-3, "top_p": 1e-3},
        {"max_new_tokens": 1, "repetition_penalty": 0.5},
        {"stop_strings": ("User:",), "seed": 0},
    ],
)
def test_valid_generation_settings(kwargs):
    settings = GenerationSettings(**kwargs)
    for key, value in kwargs.items():
        assert getattr(settings, key) == value


def test_settings_are_frozen():
    settings = GenerationSettings()
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.temperature = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"top_k": -1}, ["probe top-k", "-1"]),
        ({"prefill_rows": 0}, ["prefill rows", "at least 1", "0"]),
        ({"prefill_cells": 0}, ["prefill cells", "at least 1", "0"]),
    ],
)
def test_probe_settings_refuse_out_of_range(kwargs, words):
    with pytest.raises(SettingsError) as caught:
        ProbeSettings(**kwargs)
    for word in words:
        assert word in str(caught.value)


@pytest.mark.parametrize(
    ("queries", "keys", "cells", "expected"),
    [
        (1100, 1100, None, 256),  # no budget: the rows alone
        (100, 100, 256 * 2048, 100),  # a short prompt has fewer rows than either bound
        (2048, 2048, 256 * 2048, 256),  # rows x keys exactly at the budget
        (10_000, 10_000, 256 * 2048, 52),  # 524,288 // 10,000
        (40, 10_000, 256 * 2048, 40),  # a follow-up's new tokens over a long cached context
        (1_000_000, 1_000_000, 256 * 2048, 16),  # never fewer than FEWEST_ROWS
    ],
)
def test_prompt_rows_keep_rows_times_keys_within_the_cells(queries, keys, cells, expected):
    probes = ProbeSettings(prefill_rows=256, prefill_cells=cells)
    assert probes.prompt_rows(queries, keys) == expected
    assert rows_within(8, 256 * 2048, 1_000_000) == 8  # nor more than the rows asked for
    assert rows_within(256, 256 * 2048, 1_000_000) == FEWEST_ROWS


def test_probe_settings_off_observes_nothing():
    off = ProbeSettings.off()
    assert off.attention_layers == () and off.top_k == 0 and not off.kv_per_layer
    assert ProbeSettings(top_k=0).top_k == 0


@pytest.mark.parametrize(
    ("spec", "layers", "expected"),
    [
        ("all", 4, (0, 1, 2, 3)),
        (" ALL ", 2, (0, 1)),
        ("0,2", 4, (0, 2)),
        ("2, 0", 4, (2, 0)),
        ("-1", 30, (29,)),
        ("0,-1", 30, (0, 29)),
        ("1,1,-3", 4, (1,)),  # duplicates, also spelled from the end, count once
        ("", 4, ()),
        ("none", 4, ()),
    ],
)
def test_parse_layers(spec, layers, expected):
    assert parse_layers(spec, layers) == expected


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ("x", ["not a layer number", "'x'"]),
        ("0,,1", ["not a layer number"]),
        ("1.5", ["not a layer number", "1.5"]),
        ("0-3", ["not a layer number", "0-3"]),
        ("4", ["layer 4", "outside 0..3"]),
        ("-5", ["layer -5", "outside 0..3"]),
        ("0, 9", ["layer 9", "outside 0..3"]),
    ],
)
def test_parse_layers_refuses_bad_values(spec, words):
    with pytest.raises(SettingsError) as caught:
        parse_layers(spec, 4)
    for word in words:
        assert word in str(caught.value)


def test_message_and_load_request():
    assert Message("user", "hi").as_dict() == {"role": "user", "content": "hi"}
    request = LoadRequest()
    assert (request.spec, request.device, request.dtype) == ("bundled", "auto", "auto")


def test_the_terminal_chat_records_attention_and_candidates_only_when_asked():
    """The window bench's terminal way runs with these: what `glassbox chat` records."""
    plain = ProbeSettings.for_chat()
    assert plain.attention_layers == () and plain.top_k == 0
    traced = ProbeSettings.for_chat((0, 29), candidates=True)
    assert traced.attention_layers == (0, 29) and traced.top_k == 10
