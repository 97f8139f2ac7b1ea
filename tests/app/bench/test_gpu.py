"""app/bench/gpu.py's report, run on the CPU: its figures come from the replies it times (a
GPU machine runs the same code through `glassbox bench --device cuda`)."""

from __future__ import annotations

import json

import pytest
import torch

from app.bench import gpu


@pytest.fixture
def named_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "the test's CPU")


def test_the_engine_alone_reports_its_rates_ttft_and_first_reply(bundled_shape_fast, named_device):
    report = gpu.run(bundled_shape_fast, None, new_tokens=3, repeats=2)
    assert set(report["decode_tokens_per_s"]) == {"engine", "engine_view_on"}
    assert all(len(runs) == 2 and min(runs) > 0 for runs in report["runs"].values())
    for name, runs in report["runs"].items():
        assert report["decode_tokens_per_s"][name] == pytest.approx(sum(runs) / 2)
    first = report["first_reply"]
    assert 0 < first["ttft_s"] < first["total_s"]
    assert report["compile_s"]["engine"] == 0.0  # the CPU's step waits for no recording
    assert report["graph_replay_ms"] is None  # nor has a recorded step to replay
    assert set(report["ttft_s"]) == {"engine", "engine_view_on"}
    assert all(seconds > 0 for seconds in report["ttft_s"].values())
    off, on = (
        report["decode_tokens_per_s"]["engine"],
        report["decode_tokens_per_s"]["engine_view_on"],
    )
    assert report["view_on_cost"] == pytest.approx(1 - on / off)
    assert "engine_vs_generate_static" not in report
    assert report["device"] == "the test's CPU"


def test_with_the_exact_model_generate_is_timed_beside_it(
    bundled_shape_fast, bundled_shape_exact, named_device, monkeypatch
):
    calls: list[dict] = []

    def rate(loaded, ids, new_tokens, **options):  # generate itself is timed in test_speed
        calls.append(options)
        return 50.0 if options else 10.0

    monkeypatch.setattr(gpu, "generate_decode_rate", rate)
    report = gpu.run(bundled_shape_fast, bundled_shape_exact, new_tokens=3, repeats=1)
    assert report["decode_tokens_per_s"]["generate_static"] == 50.0
    assert report["decode_tokens_per_s"]["generate_dynamic"] == 10.0
    assert calls[0] == {"cache_implementation": "static"}  # its first reply: the compile
    assert len(calls) == 3
    assert report["engine_vs_generate_static"] == pytest.approx(
        report["decode_tokens_per_s"]["engine"] / 50.0
    )
    assert set(report["compile_s"]) == {"engine", "generate_static"}


def test_the_command_loads_a_shape_and_reports_it_with_its_load_time(
    tmp_path, monkeypatch, shapes_cache, bundled_shape, named_device, capsys
):
    from app.bench.command import cuda_bench
    from app.options import parser

    monkeypatch.setenv("GLASSBOX_CACHE_DIR", str(shapes_cache))  # where bundled_shape is
    monkeypatch.setattr(gpu, "cuda_missing", lambda: None)  # the CPU stands in for the GPU
    options = ["--model", "shape:bundled", "--fast-only", "--new-tokens", "2", "--repeats", "1"]
    output = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--no-compile", *options, "--output", str(output)]
    assert cuda_bench(parser().parse_args(argv)) == 0
    report = json.loads(output.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["shape"] == "bundled"
    assert report["model"] == bundled_shape.name
    assert list(report["load_s"]) == ["fast"]
    assert report["load_s"]["fast"] > 0
    assert set(report["decode_tokens_per_s"]) == {"engine", "engine_view_on"}


def test_with_int4_the_int4_form_is_loaded_and_timed_beside_bf16(
    tmp_path, monkeypatch, shapes_cache, bundled_shape, named_device, capsys
):
    """--int4 loads the fast model a second time with GLASSBOX_CUDA_INT4=1 (on the CPU the
    form is the same: the plumbing is what runs here) and leaves the variable as it was."""
    import os

    from app.bench import command
    from app.options import parser

    monkeypatch.setenv("GLASSBOX_CACHE_DIR", str(shapes_cache))
    monkeypatch.setattr(gpu, "cuda_missing", lambda: None)
    monkeypatch.delenv("GLASSBOX_CUDA_INT4", raising=False)
    seen: list[str | None] = []
    from engine.load import loader

    real = loader.load_model  # the command imports it when it runs: patched here

    def noting(request, *args, **kwargs):
        seen.append(os.environ.get("GLASSBOX_CUDA_INT4"))
        return real(request, *args, **kwargs)

    monkeypatch.setattr(loader, "load_model", noting)
    options = ["--model", "shape:bundled", "--fast-only", "--new-tokens", "2", "--repeats", "1"]
    output = tmp_path / "bench.json"
    argv = ["bench", "--device", "cpu", "--no-compile", "--int4", *options, "--output", str(output)]
    assert command.cuda_bench(parser().parse_args(argv)) == 0
    capsys.readouterr()
    report = json.loads(output.read_text())
    assert seen == [None, "1"]  # the bf16 form, then the int4 one
    assert "GLASSBOX_CUDA_INT4" not in os.environ
    assert set(report["load_s"]) == {"fast", "fast_int4"}
    assert set(report["decode_tokens_per_s"]) == {"engine", "engine_view_on", "engine_int4"}
    rates = report["decode_tokens_per_s"]
    assert report["int4_vs_bf16"] == pytest.approx(rates["engine_int4"] / rates["engine"])


def test_the_engines_rates_wait_for_its_recorded_buckets(bundled_shape_fast, named_device):
    from dataclasses import replace

    waited: list = []

    class Recording:  # engine/step/static.py's StepState, its buckets recorded in 1 s
        state = "cuda graph (torch.compile)"

        def recorded(self, timeout):
            waited.append(timeout)
            return [256, 512], True

    fast = replace(bundled_shape_fast, compiling=Recording())
    report = gpu.run(fast, None, new_tokens=3, repeats=1)
    assert waited == [gpu.RECORDING_WAIT_S]
    recording = report["recording"]
    assert recording["buckets"] == [256, 512] and recording["all_ready"]
    assert recording["recording_s"] >= report["first_reply"]["total_s"] > 0
    assert report["decode_step"] == "cuda graph (torch.compile)"


def test_a_recorded_step_is_replayed_alone_for_the_devices_own_time(tmp_path, tokenizer):
    from dataclasses import replace

    from engine.load.loader import LoadedModel, describe_fast
    from engine.step.static import EAGER, StaticDecode
    from tests.engine.model.test_fast import hf_model
    from tests.engine.step.test_static import build
    from tests.gguf_files import Q4_1, Q8_0, write_gguf

    model = build(write_gguf(tmp_path / "llama.gguf", hf_model("llama"), Q4_1, Q8_0))
    replays = []

    def record(step, inputs, warm):
        return lambda: replays.append(1) or step(*inputs)

    static = StaticDecode(model, EAGER, "test", first=16, record=record, ahead=16)
    model.static_step = static
    loaded = LoadedModel(model, tokenizer, describe_fast(model, "llama.gguf", "gguf"))
    assert gpu._replay_ms(loaded) is None  # nothing recorded yet
    static.plan(0)
    assert static.recorder.idle(60)
    assert gpu._replay_ms(replace(loaded), replays=7) > 0
    assert len(replays) == 1 + 7  # one to warm up, then the timed ones
    static.close()
