"""The loader: what a model spec names, a clear error for everything that is not a model,
folder and GGUF loading with progress and without a dequantised copy, device and dtype picks,
and the numbers `describe` reports."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForMaskedLM

from engine.load.loader import (
    ModelLoadError,
    bundled_gguf_path,
    describe,
    load_model,
    resolve,
)
from engine.measure.device import pick_device, pick_dtype
from engine.settings import LoadRequest
from tests.models import make_tiny

CPU = torch.device("cpu")


def load_error(spec: str, tmp_path: Path, **request) -> str:
    with pytest.raises(ModelLoadError) as caught:
        load_model(LoadRequest(spec=spec, device="cpu", **request), cache_dir=tmp_path)
    message = str(caught.value)
    assert message and "\n" not in message and "Traceback" not in message
    return message


# -- resolve ---------------------------------------------------------------------------------


def test_resolve_bundled_names_the_shipped_gguf():
    for spec in ("bundled", "", "  bundled "):
        source, location = resolve(spec)
        assert source == "bundled"
        assert location == str(bundled_gguf_path())
        assert location.endswith(".gguf") and Path(location).is_file()


def test_resolve_gguf_file_folder_and_hub_id(tmp_path, monkeypatch):
    gguf = tmp_path / "model.GGUF"
    gguf.write_bytes(b"GGUF")
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve(str(gguf)) == ("gguf", str(gguf.resolve()))
    assert resolve(str(folder)) == ("folder", str(folder.resolve()))
    monkeypatch.chdir(tmp_path)  # relative paths resolve against the working directory
    assert resolve("my-model") == ("folder", str(folder.resolve()))
    assert resolve("./my-model/") == ("folder", str(folder.resolve()))
    assert resolve("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "hub",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
    )
    assert resolve("gpt2") == ("hub", "gpt2")


@pytest.mark.parametrize("spec", ["/no/such/model", "./missing", "~/no-such-glassbox-model"])
def test_resolve_missing_local_path(spec):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve(spec)


def test_resolve_missing_gguf_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve("model.gguf")


# -- errors a user can act on ------------------------------------------------------------------


def test_missing_path(tmp_path):
    message = load_error(str(tmp_path / "nothing-here"), tmp_path)
    assert "nothing-here" in message and "does not exist" in message


def test_folder_without_config(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    (folder / "weights.bin").write_bytes(b"\0" * 16)
    message = load_error(str(folder), tmp_path)
    assert "config.json" in message


def test_file_that_is_not_gguf(tmp_path):
    notes = tmp_path / "model.safetensors"
    notes.write_bytes(b"not a model")
    message = load_error(str(notes), tmp_path)
    assert "not a .gguf" in message


def test_random_bytes_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(os.urandom(4096))
    message = load_error(str(junk), tmp_path)
    assert "junk.gguf" in message and "not a readable GGUF" in message
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_a_cache_folder_that_cannot_be_made_is_a_load_error(tmp_path):
    """Where GLASSBOX_CACHE_DIR points under a file: a sentence naming the folder, no
    traceback (the tokenizer, packs and kernels are written there)."""
    (tmp_path / "a-file").write_text("not a folder")
    cache = tmp_path / "a-file" / "cache"
    with pytest.raises(ModelLoadError, match="GLASSBOX_CACHE_DIR") as caught:
        load_model(LoadRequest(spec="bundled", device="cpu"), cache_dir=cache)
    assert str(cache) in str(caught.value)


def test_truncated_bundled_gguf(tmp_path):
    """The first megabyte of the real file: a valid header whose tensors run off the end."""
    with bundled_gguf_path().open("rb") as source:
        head = source.read(1 << 20)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(head)
    message = load_error(str(truncated), tmp_path)
    assert "truncated.gguf" in message and "not a readable GGUF" in message
    models = tmp_path / "models"
    assert not models.exists() or not any(models.iterdir())  # no half-written copy is kept


def test_encoder_config_is_not_a_causal_model(tmp_path):
    folder = tmp_path / "bert"
    config = BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        architectures=["BertForMaskedLM"],
    )
    config.save_pretrained(folder)
    message = load_error(str(folder), tmp_path)
    assert "'bert'" in message and "not a causal language model" in message


def test_saved_masked_lm_is_not_a_causal_model(tmp_path, tokenizer):
    """BERT has a causal class too; a masked-LM checkpoint must still be refused."""
    folder = tmp_path / "bert-full"
    config = BertConfig(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    BertForMaskedLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    message = load_error(str(folder), tmp_path)
    assert "not a causal language model" in message


def test_vision_config_is_not_a_causal_model(tmp_path):
    from transformers import ViTConfig

    folder = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2).save_pretrained(folder)
    message = load_error(str(folder), tmp_path)
    assert "'vit'" in message and "not a causal language model" in message


def test_hub_id_offline_fails_fast_and_clearly(tmp_path):
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    start = time.perf_counter()
    message = load_error("glassbox-tests/no-such-model", tmp_path)
    assert time.perf_counter() - start < 10
    assert "glassbox-tests/no-such-model" in message
    assert "hub" in message and "network" in message


def test_unknown_dtype(tmp_path, tiny_folder):
    message = load_error(str(tiny_folder), tmp_path, dtype="float64")
    assert "float64" in message and "float32" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_requested_without_cuda(tmp_path, tiny_folder):
    with pytest.raises(ModelLoadError, match="CUDA"):
        load_model(LoadRequest(spec=str(tiny_folder), device="cuda"), cache_dir=tmp_path)


# -- loading a folder --------------------------------------------------------------------------


def test_load_folder_reports_rising_progress(tiny_folder, tmp_path):
    stages: list[tuple[str, float]] = []
    loaded = load_model(
        LoadRequest(spec=str(tiny_folder), device="cpu"),
        progress=lambda stage, fraction: stages.append((stage, fraction)),
        cache_dir=tmp_path,
    )
    fractions = [fraction for _, fraction in stages]
    assert len(stages) >= 3
    assert all(stage.strip() for stage, _ in stages)
    assert fractions == sorted(fractions) and 0 <= fractions[0] < 1
    assert fractions[-1] == 1.0
    info = loaded.info
    assert (info.source, info.name) == ("folder", str(tiny_folder.resolve()))
    assert info.architecture == "LlamaForCausalLM"
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (3, 4, 2, 16)
    assert (info.device, info.dtype, info.bytes_per_value) == ("cpu", "float32", 4)
    assert not loaded.model.training
    assert loaded.tokenizer.pad_token_id is not None
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.shape == (1, 3, info.vocab_size)
    assert not (tmp_path / "models").exists()  # only GGUF files are copied into the cache


def test_load_folder_in_an_explicit_dtype(tiny_folder, tmp_path):
    loaded = load_model(
        LoadRequest(spec=str(tiny_folder), device="cpu", dtype="bfloat16"), cache_dir=tmp_path
    )
    assert loaded.info.dtype == "bfloat16" and loaded.info.bytes_per_value == 2
    assert next(loaded.model.parameters()).dtype == torch.bfloat16


@pytest.mark.bundled
def test_gguf_loads_without_a_model_copy_and_keeps_only_its_tokenizer(tmp_path):
    """Both precisions read the GGUF itself; the tokenizer is converted once and kept, and so
    are the fast path's 4-bit weights as its kernels read them."""
    from engine.load.tokenizer import file_key

    stages: list[tuple[str, float]] = []
    path = bundled_gguf_path()
    older = tmp_path / "tokenizers" / f"{path.stem}-{file_key(path)}"  # before merges as strings
    older.mkdir(parents=True)
    (older / "tokenizer.json").write_text("{}")
    exact = load_model(
        LoadRequest(spec="bundled", device="cpu", precision="exact"),
        lambda s, f: stages.append((s, f)),
        cache_dir=tmp_path,
    )
    assert any("Converting the tokenizer" in stage for stage, _ in stages)
    fractions = [fraction for _, fraction in stages]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0
    assert any("tensors)" in stage for stage, _ in stages)  # progress per tensor
    assert not (tmp_path / "models").exists()  # no dequantised copy on disk
    kept = list((tmp_path / "tokenizers").iterdir())
    assert len(kept) == 1 and (kept[0] / "tokenizer.json").is_file()  # the older one removed
    assert not kept[0].name.startswith(".")  # the staging folder was renamed into place
    assert sum(f.stat().st_size for f in kept[0].iterdir()) < 10 * 2**20

    stages.clear()
    fast = load_model(
        LoadRequest(spec="bundled", device="cpu"), lambda s, f: stages.append((s, f)), tmp_path
    )
    assert not any("Converting" in stage for stage, _ in stages)
    assert list((tmp_path / "tokenizers").iterdir()) == kept
    assert (exact.info.precision, fast.info.precision) == ("exact", "fast")  # auto -> fast
    packs = list((tmp_path / "packed").iterdir())  # the fast path's repacked 4-bit weights
    assert len(packs) == 1 and packs[0].stat().st_size < 100 * 2**20  # float32 would be 540 MB
    written_at = packs[0].stat().st_mtime_ns
    load_model(LoadRequest(spec="bundled", device="cpu"), cache_dir=tmp_path)
    assert packs[0].stat().st_mtime_ns == written_at  # read back, not repacked
    assert exact.info.architecture == "LlamaForCausalLM"
    assert exact.info.source == fast.info.source == "bundled"
    for field in ("layers", "heads", "kv_heads", "head_dim", "vocab_size", "max_context",
                  "parameters"):  # fmt: skip
        assert getattr(exact.info, field) == getattr(fast.info, field), field
    # The fast path's lean tokenizer against transformers' on the same tokenizer.json
    text = "Glassbox shows how a model reads: ünïcödé, 数字 123, and <|im_end|> too."
    ids = exact.tokenizer(text)["input_ids"]
    assert fast.tokenizer(text)["input_ids"] == ids
    for skip in (True, False):
        assert fast.tokenizer.decode(ids, skip_special_tokens=skip) == exact.tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False
        )
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    for messages in (chat, chat[1:]):  # the template adds a system prompt when none is given
        rendered = exact.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert (
            fast.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == rendered
        )
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "eos_token"):
        assert getattr(fast.tokenizer, name) == getattr(exact.tokenizer, name), name
    assert "transformers" not in type(fast.tokenizer).__module__


@pytest.mark.bundled
def test_an_architecture_the_own_model_cannot_read_loads_in_memory_in_bf16(monkeypatch, tmp_path):
    """transformers' own GGUF reader, dequantised in memory to bf16: nothing but the tokenizer
    is written to the cache folder (the bundled file, taken for one the own model refuses)."""
    import engine.load.route

    monkeypatch.setattr(
        engine.load.route, "unsupported_by_own_model", lambda file: "architecture 'x'"
    )
    loaded = load_model(LoadRequest(spec="bundled", device="cpu", precision="auto"),
                        cache_dir=tmp_path)  # fmt: skip
    assert loaded.info.precision == "exact" and loaded.info.dtype == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizers"]
    message = load_error("bundled", tmp_path, precision="fast")
    assert "architecture 'x'" in message and "Choose exact" in message


@pytest.mark.bundled
def test_exact_gguf_model_equals_transformers_own_gguf_loader(bundled):
    """The exact model built from the file matches transformers' GGUF loader (a reference
    that dequantises and un-permutes the weights with its own code)."""
    from transformers import AutoModelForCausalLM

    path = bundled_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = torch.tensor([bundled.tokenizer("The capital of France is")["input_ids"]])
    with torch.inference_mode():
        torch.testing.assert_close(
            bundled.model(input_ids=ids).logits, reference(input_ids=ids).logits,
            rtol=1e-5, atol=1e-4,
        )  # fmt: skip


def test_precision_fast_refuses_folders_and_hub_ids(tiny_folder, tmp_path):
    message = load_error(str(tiny_folder), tmp_path, precision="fast")
    assert "GGUF" in message and "exact" in message


# -- device and dtype ------------------------------------------------------------------------


def test_cpu_runs_in_float32():
    assert pick_device("cpu") == CPU
    assert pick_dtype(CPU) == torch.float32
    assert pick_dtype(CPU, "auto") == torch.float32


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)],
)
def test_explicit_dtype(name, dtype):
    assert pick_dtype(CPU, name) == dtype


def test_unknown_dtype_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown dtype 'int8'.*float32, bfloat16, float16"):
        pick_dtype(CPU, "int8")


def test_auto_device_is_one_that_exists():
    device = pick_device("auto")
    if torch.cuda.is_available():
        assert device.type == "cuda"
    elif torch.backends.mps.is_available():
        assert device.type == "mps"
    else:
        assert device == CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(ValueError, match="no CUDA device"):
        pick_device("cuda:0")


@pytest.mark.parametrize("name", ["tpu", "xla", "meta", "cuda:x", ""])
def test_an_unknown_device_names_the_choices(name):
    with pytest.raises(ValueError, match=r"unknown device .*auto, cpu, cuda, cuda:N or mps"):
        pick_device(name)


def test_a_cuda_index_beyond_the_cards_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert pick_device("cuda:0") == torch.device("cuda:0")
    with pytest.raises(ValueError, match="cuda:1 was requested but this machine has 1 CUDA"):
        pick_device("cuda:1")


# -- describe ----------------------------------------------------------------------------------


def test_describe_tiny_llama(tokenizer):
    model = make_tiny(tokenizer, "llama").model
    info = describe(model, "tiny", "memory")
    assert (info.name, info.source, info.architecture) == ("tiny", "memory", "LlamaForCausalLM")
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (3, 4, 2, 16)
    assert info.parameters == sum(p.numel() for p in model.parameters())
    assert info.vocab_size == 49152
    assert info.max_context == model.config.max_position_embeddings
    assert (info.dtype, info.bytes_per_value, info.device) == ("float32", 4, "cpu")
    assert info.sliding_layers == () and info.sliding_window is None


def test_describe_gemma3_sliding_layers(tokenizer):
    info = make_tiny(tokenizer, "gemma3").info
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (2, 4, 2, 16)
    assert info.sliding_layers == (0,)
    assert info.sliding_window == 8


def test_describe_gpt2_multi_head(tokenizer):
    info = make_tiny(tokenizer, "gpt2").info
    assert (info.layers, info.heads, info.kv_heads, info.head_dim) == (2, 4, 4, 16)
    assert info.max_context == 256


def test_the_direct_tokenizer_conversion_equals_autotokenizers(tmp_path):
    """The first start converts the GGUF's tokenizer through transformers' own builders,
    skipping AutoTokenizer's config parse: the same tokenizer.json and chat template."""
    from transformers import AutoTokenizer

    from engine.load.tokenizer import _tokenizer_converter

    path = bundled_gguf_path()
    ours, reference = tmp_path / "ours", tmp_path / "reference"
    _tokenizer_converter()(path).save_pretrained(ours)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(reference)
    for name in ("tokenizer.json", "chat_template.jinja"):
        assert (ours / name).read_text() == (reference / name).read_text(), name


def test_merges_kept_as_strings_encode_and_decode_as_the_pairs_did(tmp_path):
    """The cached tokenizer.json keeps BPE merges as "a b" strings (a third of the pairs'
    parse peak on Gemma 3): the same ids and text as transformers' pair form."""
    from tokenizers import Tokenizer

    from engine.load.tokenizer import _tokenizer_converter
    from engine.text.tokenizer import compact_merges

    _tokenizer_converter()(bundled_gguf_path()).save_pretrained(tmp_path)
    file = tmp_path / "tokenizer.json"
    pairs = Tokenizer.from_file(str(file))
    assert compact_merges(file)
    strings = Tokenizer.from_file(str(file))
    merges = json.loads(file.read_text())["model"]["merges"]
    assert isinstance(merges[0], str) and len(merges) > 40_000
    text = "Glassbox shows inference:\n\tKV cache, attention — ünïcødé 123 <|im_start|>"
    assert strings.encode(text).ids == pairs.encode(text).ids
    assert strings.decode(strings.encode(text).ids) == pairs.decode(pairs.encode(text).ids)
    assert not compact_merges(file)  # already strings: left as it is


def test_merges_with_a_space_in_a_token_stay_pairs(tmp_path):
    """ "a b" would be ambiguous where a token holds a space: such a file is left alone."""
    from engine.text.tokenizer import compact_merges

    file = tmp_path / "tokenizer.json"
    model = {"type": "BPE", "vocab": {"a": 0, " b": 1, "a b": 2}, "merges": [["a", " b"]]}
    file.write_text(json.dumps({"model": model}))
    before = file.read_text()
    assert not compact_merges(file)
    assert file.read_text() == before
