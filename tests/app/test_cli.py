"""`glassbox chat` and `glassbox bench` as a user runs them: a separate process, real output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GLASSBOX = Path(sys.executable).with_name("glassbox")


def run_app(*args: str, stdin: str | None = None, command=None) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "GLASSBOX_CACHE_DIR": os.environ["GLASSBOX_CACHE_DIR"],
        "PYTHONIOENCODING": "utf-8",
    }
    command = command or [sys.executable, "-m", "app"]
    return subprocess.run(
        [*command, *args],
        cwd=ROOT,
        env=env,
        input=stdin,
        stdin=None if stdin is not None else subprocess.DEVNULL,
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=300,
    )


def json_lines(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert lines, "no output"
    return [json.loads(line) for line in lines]  # every line is one JSON object


def assert_clean_error(result: subprocess.CompletedProcess, code: int, *words: str) -> str:
    """Exit `code` with one `glassbox chat: ...` line as the last thing on stderr."""
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("glassbox chat:")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    for word in words:
        assert word in errors[0]
    return errors[0]


@pytest.fixture(scope="module")
def one_shot(tiny_folder, tmp_path_factory):
    """One JSON-lines reply that also writes a trace of every layer."""
    trace = tmp_path_factory.mktemp("trace") / "reply.json"
    result = run_app(
        "chat", "--model", str(tiny_folder), "--prompt", "hi", "--greedy",
        "--max-new-tokens", "5", "--json", "--trace", str(trace), "--watch-layers", "all",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json_lines(result.stdout), json.loads(trace.read_text())


def test_json_lines_are_events(one_shot):
    events, _ = one_shot
    model, events = events[0], events[1:]
    assert model["event"] == "model" and model["precision"] == "exact"  # a folder runs exact
    assert model["layers"] == 3 and model["bytes_per_value"] == 4
    assert model["peaks"]["peak_flops_per_s"] > 0 and model["peaks"]["dtype"] == "float32"
    kinds = [e["event"] for e in events]
    assert kinds[0] == "prefill" and kinds[-1] == "finished"
    assert set(kinds[1:-1]) == {"token"}
    tokens = [e for e in events if e["event"] == "token"]
    for index, token in enumerate(tokens):
        assert isinstance(token["token_id"], int) and isinstance(token["text"], str)
        assert token["index"] == index
    finished = events[-1]
    for key in (
        "finish_reason", "prompt_tokens", "reused_tokens", "generated_tokens",
        "ttft_s", "decode_tokens_per_s",
    ):  # fmt: skip
        assert key in finished
    assert finished["finish_reason"] in ("length", "eos")
    assert finished["generated_tokens"] == len(tokens) <= 5
    assert finished["prompt_tokens"] == events[0]["prompt_tokens"] > 0
    assert finished["reused_tokens"] == 0
    assert finished["ttft_s"] > 0 and finished["decode_tokens_per_s"] >= 0
    assert "".join(t["text"] for t in tokens) == finished["text"]


def test_trace_has_the_documented_shape(one_shot):
    events, trace = one_shot
    model = trace["model"]
    assert (model["layers"], model["heads"], model["kv_heads"], model["head_dim"]) == (3, 4, 2, 16)
    assert (model["dtype"], model["precision"]) == ("float32", "exact")
    layers, heads = model["layers"], model["heads"]

    prompt = trace["prompt_token_ids"]
    assert prompt == events[1]["prompt_token_ids"]  # after the "model" line
    tokens = [e for e in events if e["event"] == "token"]
    assert trace["generated_token_ids"] == [t["token_id"] for t in tokens]

    prefill = trace["prefill"]
    assert prefill["tokens"] == len(prompt) and prefill["reused_tokens"] == 0
    assert prefill["seconds"] > 0
    assert set(prefill["attention"]) == {str(layer) for layer in range(layers)}
    n = len(prompt)
    for matrix in prefill["attention"].values():
        assert len(matrix) == heads
        for head in matrix:
            assert len(head) == n and all(len(row) == n for row in head)
            for query, row in enumerate(head):
                assert sum(row) == pytest.approx(1.0, abs=1e-4)
                assert all(weight == 0 for weight in row[query + 1 :])  # causal

    steps = trace["steps"]
    assert [s["token_id"] for s in steps] == trace["generated_token_ids"]
    for index, step in enumerate(steps):
        assert step["seconds"] > 0
        assert len(step["kv_bytes_per_layer"]) == layers
        assert sum(step["kv_bytes_per_layer"]) == step["kv_bytes"] > 0
        top_k = step["top_k"]
        assert len(top_k) == 10
        assert all({"token_id", "text", "prob"} <= set(c) for c in top_k)
        probs = [c["prob"] for c in top_k]
        assert probs == sorted(probs, reverse=True)
        assert top_k[0]["token_id"] == step["token_id"]  # greedy takes the likeliest
        if index == 0:  # its query row is the prefill matrix's last row
            assert step["attention"] == {}
            continue
        assert set(step["attention"]) == set(prefill["attention"])
        for weights in step["attention"].values():
            assert len(weights) == heads
            for row in weights:  # the new token's query over the prompt and earlier tokens
                assert len(row) == n + index
                assert sum(row) == pytest.approx(1.0, abs=1e-4)
    sizes = [s["kv_bytes"] for s in steps]
    assert sizes == sorted(sizes)


def test_every_command_takes_a_precision():
    from app.options import load_request, parser

    for command in ([], ["chat"], ["bench"]):
        assert load_request(parser().parse_args(command)).precision == "auto"
        fast = parser().parse_args([*command, "--precision", "fast"])
        assert load_request(fast).precision == "fast"


def test_every_command_takes_a_chat_template():
    from app.options import load_request, parser

    for command in ([], ["chat"], ["bench"]):
        assert load_request(parser().parse_args(command)).chat_template == "auto"
        plain = parser().parse_args([*command, "--chat-template", "plain"])
        assert load_request(plain).chat_template == "plain"
    with pytest.raises(SystemExit):
        parser().parse_args(["chat", "--chat-template", "alpaca"])


def test_model_options_are_one_definition_wherever_they_are_given():
    from app.options import load_request, parser

    window = load_request(parser().parse_args(["--model", "a.gguf", "--device", "cpu"]))
    chat = load_request(parser().parse_args(["chat", "--model", "a.gguf", "--device", "cpu"]))
    before = load_request(parser().parse_args(["--model", "a.gguf", "--device", "cpu", "chat"]))
    assert window == chat == before
    assert before.spec == "a.gguf" and before.device == "cpu" and before.dtype == "auto"
    with pytest.raises(SystemExit):
        parser().parse_args(["chat", "--precision", "quick"])  # one validation everywhere


def test_help_lists_the_commands():
    result = run_app("--help")
    assert result.returncode == 0
    for command in ("chat", "bench", "peaks"):
        assert command in result.stdout
    assert "--model" in result.stdout  # the window's own options
    chat = run_app("chat", "--help")
    assert chat.returncode == 0 and "--complete" in chat.stdout and "--model" in chat.stdout


def test_peaks_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_CACHE_DIR", str(tmp_path))
    first = run_app("peaks", "--json", "--quick", "--device", "cpu", "--dtype", "float32")
    assert first.returncode == 0, first.stderr
    (peaks,) = json_lines(first.stdout)
    assert peaks["peak_flops_per_s"] > 0 and peaks["peak_bytes_per_s"] > 0
    assert peaks["dtype"] == "float32" and peaks["device"] == "cpu"
    assert "matmul" in peaks["method"] and "cop" in peaks["method"]
    assert peaks["ridge_flops_per_byte"] == pytest.approx(
        peaks["peak_flops_per_s"] / peaks["peak_bytes_per_s"]
    )
    assert (tmp_path / "peaks.json").is_file()
    again = json_lines(run_app("peaks", "--json", "--quick", "--device", "cpu",
                               "--dtype", "float32").stdout)  # fmt: skip
    assert again == [peaks]  # read back, not measured again
    fresh = run_app("peaks", "--json", "--quick", "--refresh", "--device", "cpu",
                    "--dtype", "float32")  # fmt: skip
    assert json_lines(fresh.stdout)[0] != peaks  # measured again: new timings
    text = run_app("peaks", "--quick", "--device", "cpu", "--dtype", "float32")
    assert "GFLOP/s" in text.stdout and "GB/s" in text.stdout


def test_peaks_refuse_an_unknown_dtype_in_one_line():
    result = run_app("peaks", "--quick", "--dtype", "float3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "float3" in result.stderr


def test_json_events_and_the_trace_carry_each_phase_roofline(one_shot):
    events, trace = one_shot
    keys = {"flops", "bytes", "intensity", "flops_per_s", "bytes_per_s", "bound"}
    prefill = events[1]
    assert set(prefill["roofline"]) == keys and prefill["roofline"]["bound"] in (
        "compute",
        "memory",
    )
    tokens = [e for e in events if e["event"] == "token"]
    assert tokens[0]["roofline"] is None  # its logits came from the prefill
    assert all(set(t["roofline"]) == keys for t in tokens[1:])
    assert trace["prefill"]["roofline"] == prefill["roofline"]
    assert [s["roofline"] for s in trace["steps"]] == [t["roofline"] for t in tokens]
    peaks = trace["model"]["peaks"]
    ridge = peaks["peak_flops_per_s"] / peaks["peak_bytes_per_s"]
    for phase in [prefill["roofline"], *(t["roofline"] for t in tokens[1:])]:
        assert phase["intensity"] == pytest.approx(phase["flops"] / phase["bytes"])
        assert phase["bound"] == ("compute" if phase["intensity"] >= ridge else "memory")


def test_complete_continues_the_text_as_written(tiny_folder, tokenizer):
    result = run_app(
        "chat", "--model", str(tiny_folder), "--complete", "--prompt", "Once upon a time",
        "--greedy", "--max-new-tokens", "3", "--json", "--no-store",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = json_lines(result.stdout)
    prefill = next(e for e in events if e["event"] == "prefill")
    assert prefill["prompt_token_ids"] == tokenizer("Once upon a time")["input_ids"]
    first = next(e for e in events if e["event"] == "token")
    assert len(first["top_k"]) == 10  # --json shows the next-token candidates


def test_fast_precision_on_a_folder_is_one_clear_line(tiny_folder):
    result = run_app("chat", "--model", str(tiny_folder), "--prompt", "hi", "--precision", "fast")
    assert_clean_error(result, 1, "GGUF", "exact")


def test_missing_model_is_one_clear_line(tmp_path):
    missing = tmp_path / "no-model-here"
    result = run_app("chat", "--model", str(missing), "--prompt", "hi", "--greedy")
    assert_clean_error(result, 1, str(missing), "does not exist")
    assert result.stdout == ""


def test_negative_temperature_is_a_usage_error(tiny_folder):
    result = run_app("chat", "--model", str(tiny_folder), "--prompt", "hi", "--temperature", "-1")
    assert_clean_error(result, 2, "temperature", "-1")


def test_a_system_prompt_in_completion_mode_is_a_usage_error(tiny_folder):
    result = run_app("chat", "--model", str(tiny_folder), "--complete", "--system", "Be kind.",
                     "--prompt", "Once")  # fmt: skip
    assert_clean_error(result, 2, "--system", "--complete")


def test_empty_prompt_is_refused_before_loading(tiny_folder):
    result = run_app("chat", "--model", str(tiny_folder), "--prompt", "", "--greedy")
    assert_clean_error(result, 2, "empty")
    assert "Loading" not in result.stderr


def interactive(folder, stdin: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """An interactive `glassbox chat --json` fed `stdin` (it ends at EOF), and its replies'
    finished events."""
    result = run_app(
        "chat", "--model", str(folder), "--greedy", "--max-new-tokens", "3", "--json",
        stdin=stdin,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result, [e for e in json_lines(result.stdout) if e["event"] == "finished"]


def test_interactive_answers_each_line_then_exits_on_eof(tiny_folder):
    _result, finished = interactive(tiny_folder, "hi\nagain\n")
    assert len(finished) == 2
    first, second = finished
    # The second turn extends the first: its prompt holds the first reply, mostly cached.
    assert second["prompt_tokens"] > first["prompt_tokens"]
    assert 0 < second["reused_tokens"] < second["prompt_tokens"]


def test_a_mistyped_command_is_said_and_not_sent(tiny_folder):
    """'/foo' looks like a command: refused with the commands; '/etc/x ...' is a message."""
    result, finished = interactive(tiny_folder, "/foo\n/etc/hosts holds what?\n")
    assert "no command /foo: /new starts over, /quit leaves" in result.stderr
    assert len(finished) == 1  # the path's question only


def test_bench_reports_decode_rates(tiny_folder):
    result = run_app(
        "bench", "--model", str(tiny_folder), "--json", "--new-tokens", "8", "--repeats", "1"
    )
    assert result.returncode == 0, result.stderr
    report = json_lines(result.stdout)[-1]
    rates = report["decode_tokens_per_s"]
    assert set(rates) == {"generate", "engine", "engine_view_on", "engine_sampled"}
    assert all(rate > 0 for rate in rates.values())
    assert report["ratio_engine_vs_generate"] > 0
    assert report["sampling_cost"] < 1
    assert report["new_tokens"] == 8 and report["repeats"] == 1


@pytest.mark.bundled
def test_bundled_model_knows_the_capital_of_france():
    assert GLASSBOX.is_file(), f"{GLASSBOX} is missing: install the package"
    result = run_app(
        "chat", "--prompt", "What is the capital of France?", "--greedy",
        "--max-new-tokens", "24", command=[str(GLASSBOX)],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    assert "Traceback" not in result.stderr


def test_a_one_shot_chat_builds_no_compiled_step_and_a_conversation_does(monkeypatch):
    import app.terminal
    from app.cli import main
    from engine.load.loader import ModelLoadError

    asked = []

    def load_model(request, progress=None):
        asked.append((request.compiled, request.build_compiled))
        raise ModelLoadError("not loaded in this test")

    monkeypatch.setattr(app.terminal, "load_model", load_model)
    assert main(["chat", "--prompt", "hi"]) == 1
    assert main(["chat"]) == 1
    assert main(["chat", "--no-compile"]) == 1
    # a one-shot uses a kept step only; --no-compile none at all
    assert asked == [(True, False), (True, True), (False, True)]


def test_step_lets_one_token_through_per_enter_and_stops_or_continues(tiny_folder):
    """`--step`: the reply is held after its prompt; each Enter lets one token through, `s`
    stops it there, `c` (or the end of input) lets it run on."""
    common = ("chat", "--model", str(tiny_folder), "--prompt", "hi", "--greedy",
              "--max-new-tokens", "5", "--json", "--no-store")  # fmt: skip
    stopped = run_app(*common, "--step", stdin="\n\ns\n")
    events = json_lines(stopped.stdout)
    tokens = [e for e in events if e["event"] == "token"]
    assert len(tokens) == 2 and events[-1]["finish_reason"] == "cancelled"
    assert stopped.stderr.count("Enter: next token") == 3  # held after the prompt and each token
    whole = run_app(*common)
    for stdin in ("\nc\n", ""):
        continued = run_app(*common, "--step", stdin=stdin)
        assert continued.returncode == 0, continued.stderr
        ids = [e["token_id"] for e in json_lines(continued.stdout) if e["event"] == "token"]
        assert ids == [e["token_id"] for e in json_lines(whole.stdout) if e["event"] == "token"]


def torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(torch_sees_cuda(), reason="this machine has CUDA: the bench would run")
def test_bench_on_cuda_without_a_cuda_device_says_so_in_one_line():
    result = run_app("bench", "--device", "cuda", "--json")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "glassbox bench --device cuda: no CUDA device here (torch sees none); nothing to measure"
    ]
    assert result.stdout == ""


def test_bench_placement_needs_a_placement_and_measures_a_placed_model(tiny_folder):
    result = run_app("bench", "--model", str(tiny_folder), "--placement", "--json")
    assert result.returncode == 1
    assert "give --max-memory or --device-map" in result.stderr
    result = run_app(
        "bench", "--model", str(tiny_folder), "--placement", "--device-map", "gpu-layers=0",
        "--max-memory", "cpu=1GiB", "--json", "--new-tokens", "4", "--repeats", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json_lines(result.stdout)[-1]["placement"]
    assert set(report["decode_tokens_per_s"]) == {"placed", "in_memory"}
    assert report["layer_places"] and set(report["layer_places"]) == {"cpu"}


def test_every_command_takes_a_placement():
    from app.options import load_request, parser

    for command in ([], ["chat"], ["bench"]):
        assert not load_request(parser().parse_args(command)).placed
        args = [*command, "--device-map", "gpu-layers=4", "--max-memory", "cpu=250MiB"]
        request = load_request(parser().parse_args(args))
        assert (request.device_map, request.max_memory) == ("gpu-layers=4", "cpu=250MiB")


def test_a_bad_placement_is_a_usage_error():
    result = run_app("chat", "--max-memory", "cpu=lots", "--prompt", "hi")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "argument --max-memory: not a size: 'lots'" in result.stderr


def test_a_folder_model_placed_partly_on_disk_chats(tiny_folder):
    # RAM for one of the tiny llama's layers (147,968 bytes): the other two are read from disk
    result = run_app(
        "chat", "--model", str(tiny_folder), "--prompt", "hi", "--greedy", "--json",
        "--max-new-tokens", "4", "--device-map", "gpu-layers=0", "--max-memory", "cpu=150000",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = json_lines(result.stdout)
    placement = events[0]["placement"]
    assert placement["layer_places"] == ["cpu", "disk", "disk"]
    tokens = [e for e in events if e["event"] == "token"]
    assert len(tokens) == 4 and tokens[0]["transfer"] is None
    for token in tokens[1:]:
        assert token["transfer"]["bytes"] == placement["moved_bytes"] == 2 * 147_968
