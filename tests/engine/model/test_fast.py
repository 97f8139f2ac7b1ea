"""The fast path: GGUF blocks repacked for the int4/int8 kernels, Glassbox's own Llama-family
model, its in-place KV cache, and its probes, against independent references: gguf's own
dequantisation, the transformers model the file was written from, and an eager forward of the
fast model itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import engine.model.layer
import engine.model.llama
from engine import kv_formula
from engine.events import Token
from engine.generate.session import ChatSession
from engine.gguf.reader import GGUFError, GGUFFile
from engine.load.loader import LoadedModel, describe_fast
from engine.model import fast_builder, reference
from engine.model.kv_buffer import KVBuffer
from engine.settings import GenerationSettings, Message, ProbeSettings
from engine.weights import linear as quant
from engine.weights.pack_cache import FORMAT, PackCache, pack_path
from tests.gguf_files import F16, F32, Q4_0, Q4_1, Q8_0, write_gguf
from tests.models import tiny_config

QUESTION = [Message("user", "Why is the sky blue? Answer briefly.")]
STEPS = 8
GREEDY = GenerationSettings(greedy=True, max_new_tokens=STEPS, ignore_eos=True)
# The reference runs the same bf16 model with float32 eager attention instead of SDPA: later
# layers see activations rounded differently, by about one bf16 step (measured: <= 6e-5).
ATTENTION_ATOL = 1e-4
# Qwen3's QK-norm scales each q and k head to unit RMS, so its q·k scores are ~√d·|w| where
# the tiny Llama's are ~0.01: the same one-bf16-step differences between the whole-sequence
# pass and the cached steps move its weights ~100x more (measured: <= 4e-3).
QK_NORM_ATTENTION_ATOL = 1e-2


def hf_model(architecture: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = tiny_config(architecture)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # QK-norm weights start at 1: make each head's own weights matter
        for name, parameter in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1.0, 0.3)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def written(request, tmp_path_factory):
    """(transformers model, GGUF path with Q4_1 weights and a Q8_0 embedding)."""
    model = hf_model(request.param)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    return model, write_gguf(path, model, Q4_1, Q8_0)


def fast_loaded(path, tokenizer) -> LoadedModel:
    model = fast_builder.build_fast(GGUFFile(path))
    return LoadedModel(model, tokenizer, describe_fast(model, path.name, "gguf"))


# -- blocks and kernels ----------------------------------------------------------------------


def quantized(rows: int, columns: int, kind: str, seed: int = 0):
    import gguf

    weights = np.random.default_rng(seed).standard_normal((rows, columns), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(weights, qtype)
    return torch.from_numpy(raw), torch.from_numpy(gguf.quants.dequantize(raw, qtype))


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0])
def test_dequantize_equals_gguf_reference(kind):
    raw, reference = quantized(96, 128, kind)
    qtype = {Q4_0: quant.Q4_0, Q4_1: quant.Q4_1, Q8_0: quant.Q8_0}[kind]
    torch.testing.assert_close(quant.dequantize(raw, qtype), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", [Q4_0, Q4_1])
@pytest.mark.parametrize("rows", [192, 80])  # 80: not a multiple of 64, packed by torch's op
def test_int4_repack_equals_the_dequantised_matmul(kind, rows):
    raw, reference = quantized(rows, 256, kind)
    qtype = quant.Q4_0 if kind == Q4_0 else quant.Q4_1
    x = torch.randn(3, 256)
    expected = x @ reference.T
    # With float32 scales the kernel reproduces the file's numbers: a repack, not a requant.
    exact = quant.Int4Linear.from_blocks(raw, qtype, torch.float32)
    torch.testing.assert_close(exact(x), expected, rtol=1e-5, atol=1e-4)
    # The fast model's form: bf16 activations and scales, within bf16 rounding.
    fast = quant.Int4Linear.from_blocks(raw, qtype, torch.bfloat16)
    error = (fast(x).float() - expected).norm() / expected.norm()
    assert error < 1e-2
    # A prefill-sized batch takes the unpacked dense matmul: the same weights.
    batch = torch.randn(quant.DENSE_ROWS + 5, 256)
    expected = batch @ reference.T
    error = (fast(batch).float() - expected).norm() / expected.norm()
    assert error < 1e-2
    if rows % 64 == 0:
        # bf16 arithmetic: about one bf16 step of the largest weight
        step = 2 * 2**-8 * float(reference.abs().max())
        torch.testing.assert_close(fast.dense().float(), reference, rtol=0, atol=step)


@pytest.mark.parametrize("rows", [64, 4096 + 64])  # the second is repacked in two chunks
def test_q8_0_splits_exactly_into_two_int4_halves(rows):
    from engine.model.fast_builder import _int4_run

    raw, reference = quantized(rows, 256, Q8_0)
    x = torch.randn(2, 256)
    expected = x @ reference.T
    linear = _int4_run([(raw, quant.Q8_0)], torch.float32)
    assert linear.packed.shape[0] == 2 * rows and linear.out_features == rows
    torch.testing.assert_close(linear(x), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(linear.dense(), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", [Q4_0, Q4_1, Q8_0, F16])
def test_row_reader_reads_the_dequantised_rows(kind):
    import gguf

    weights = np.random.default_rng(1).standard_normal((40, 128), dtype=np.float32)
    qtype = gguf.GGMLQuantizationType[kind]
    raw = torch.from_numpy(gguf.quants.quantize(weights, qtype))
    reference = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))
    rows = quant.RowReader(raw.view(torch.uint8).reshape(40, -1), int(qtype), 128)
    index = torch.tensor([3, 0, 39, 3])
    torch.testing.assert_close(rows(index), reference[index], rtol=0, atol=1e-6)
    torch.testing.assert_close(rows.all(), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n", [1, engine.model.layer.ROPE_MATRIX_ROWS, 40])
def test_rope_equals_the_rotate_half_formula(n):
    """The per-position rotation matrices (short passes) and the elementwise form (long ones)
    against RoPE as transformers writes it: x·cos + rotate_half(x)·sin, in float32."""
    torch.manual_seed(0)
    d, start = 64, 1000
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    x = torch.randn(n, 12, d).bfloat16()
    angles = torch.outer(torch.arange(start, start + n).float(), inv_freq)
    angles = torch.cat([angles, angles], -1)[:, None]
    xf = x.float()
    rotated = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], -1)
    expected = (xf * angles.cos() + rotated * angles.sin()).bfloat16()
    rope = engine.model.layer.Rope(inv_freq, start, n)
    assert (rope.matrix is not None) == (n <= engine.model.layer.ROPE_MATRIX_ROWS)
    # float32 either way; a fused multiply-add can round an element 1 ulp apart, which now and
    # then moves its bf16 rounding by one step
    torch.testing.assert_close(rope(x).float(), expected.float(), rtol=2**-7, atol=1e-6)


def test_a_gpu_rotates_elementwise_and_a_cpu_by_matrices_for_short_passes():
    """On a GPU the rotation fuses into the compiled step's own kernels (layer.rope_matrix_rows)."""
    rows = engine.model.layer.rope_matrix_rows
    assert rows(torch.device("cpu")) == engine.model.layer.ROPE_MATRIX_ROWS
    assert rows(torch.device("cuda", 0)) == 0 and rows(torch.device("mps")) == 0


def test_the_norms_matmul_and_reduction_give_one_inverse_rms():
    """layer.inverse_rms: the CPU's x·xᵀ matmul and the GPU's reduction, each within float32's
    rounding of the float64 value, and the device picks which (the CPU: the matmul)."""
    torch.manual_seed(0)
    eps = torch.full((1, 1), 1e-5)
    for scale in (1e-3, 1.0, 300.0):  # a quiet and a loud residual stream
        x = torch.randn(1, 576) * scale
        exact = 1 / (x.double().square().mean() + 1e-5).sqrt()
        for matmul in (True, False):
            got = engine.model.layer.inverse_rms(x, eps, matmul)
            assert got.shape == (1, 1) and got.dtype == torch.float32
            torch.testing.assert_close(got.double()[0, 0], exact, rtol=1e-6, atol=0)
        picked = engine.model.layer.inverse_rms(x, eps)
        assert torch.equal(picked, engine.model.layer.inverse_rms(x, eps, matmul=True))


@pytest.mark.parametrize("matrix", [True, False], ids=["matrices", "elementwise"])
def test_a_decode_steps_rotation_is_its_row_of_a_chunk(matrix):
    """RopeRows: a one-token pass's rotation, made a chunk of positions ahead, rotates as a
    Rope made for its position alone, across chunks (and back to an earlier one)."""
    d = 64
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    rows = engine.model.llama.RopeRows(inv_freq, matrix)
    chunk = engine.model.llama.ROPE_CHUNK
    x = torch.randn(1, 12, d).bfloat16()
    for position in [0, 1, chunk - 1, chunk, 5 * chunk + 3, 7]:
        row = rows.at(position)
        alone = engine.model.layer.Rope(inv_freq, position, 1, 1 if matrix else 0)
        assert (row.matrix is not None) == matrix
        assert [t.shape for t in row.tensors()] == [t.shape for t in alone.tensors()]
        for got, expected in zip(row.tensors(), alone.tensors(), strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
        torch.testing.assert_close(row(x), alone(x), rtol=0, atol=0)


def test_a_moved_model_makes_its_rotations_anew(written, tokenizer):
    """The chunks follow the model's RoPE buffers: new ones (the model moved) make new rows."""
    _, path = written
    model = fast_loaded(path, tokenizer).model
    (first,) = model.ropes(7, 1)
    assert model.ropes(8, 1)[0].tensors()[0].device == first.tensors()[0].device
    kept = model._rope_rows
    model.inv_freq = model.inv_freq.clone()  # as .to(device) replaces a buffer
    model.ropes(9, 1)
    assert model._rope_rows is not kept and model._rope_rows[0].inv_freq is model.inv_freq


@pytest.mark.parametrize("n", [1, 5])
def test_rms_norm_equals_the_fused_op(n):
    """One position takes the matmul form, more take F.rms_norm: both as F.rms_norm in
    float32, rounded once to bf16."""
    torch.manual_seed(n)
    x, weight = torch.randn(n, 576) * 4, torch.randn(576)
    expected = torch.nn.functional.rms_norm(x, (576,), weight, 1e-5).bfloat16()
    got = engine.model.llama.rms_norm(x, weight, 1e-5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=2**-8, atol=0)


# -- the file reader ---------------------------------------------------------------------------


def test_gguf_file_reads_what_gguf_reader_reads(written):
    import gguf

    _, path = written
    reference = gguf.GGUFReader(path)
    ours = GGUFFile(path)
    assert ours.get("general.architecture") == reference.fields["general.architecture"].contents()
    model, _ = written
    architecture = ours.get("general.architecture")
    assert ours.get(f"{architecture}.block_count") == model.config.num_hidden_layers
    assert set(ours.tensors) == {t.name for t in reference.tensors}
    for tensor in reference.tensors:
        info = ours.tensors[tensor.name]
        assert info.type == int(tensor.tensor_type)
        assert info.shape == tuple(reversed([int(n) for n in tensor.shape]))
        stored = np.asarray(tensor.data).view(np.uint8).reshape(-1)
        assert np.array_equal(ours.read(tensor.name).reshape(-1), stored)
        assert np.array_equal(ours.raw(tensor.name).reshape(-1), stored)


def test_truncated_gguf_is_a_clear_error(written, tmp_path):
    _, path = written
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(GGUFError, match="past the end"):
        GGUFFile(cut)


# -- the models against the transformers model the file was written from ------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_exact_model_from_a_lossless_gguf_equals_the_original(architecture, tmp_path):
    """F32 tensors: the exact model must be the original, q/k un-permuted back exactly."""
    original = hf_model(architecture)
    path = write_gguf(tmp_path / "f32.gguf", original, F32, F32)
    rebuilt = reference.build_exact(GGUFFile(path), torch.float32)
    ids = torch.randint(0, 49152, (1, 16))
    with torch.inference_mode():
        torch.testing.assert_close(rebuilt(ids).logits, original(ids).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("weights", "embedding"), [(Q4_0, Q8_0), (Q4_1, F16), (Q8_0, Q4_1),
                                                    (F16, F32)])  # fmt: skip
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "qwen3"])
def test_fast_model_follows_the_exact_model_of_the_same_file(
    architecture, weights, embedding, tmp_path
):
    """Same file, two models: bf16 activations separate them, and where the lm_head is not
    Q4, its 4-bit requantised bulk (only the top logits are recomputed exactly; a random model
    has no clear top, so its whole row of logits is compared, with a wider tolerance)."""
    path = write_gguf(tmp_path / "q.gguf", hf_model(architecture), weights, embedding)
    file = GGUFFile(path)
    exact = reference.build_exact(file, torch.float32)
    fast = fast_builder.build_fast(file)
    ids = torch.randint(0, 49152, (1, 24))
    with torch.inference_mode():
        expected = exact(ids).logits[0]
    logits = fast.forward(ids, None, None, every_position=True)
    scale = expected.abs().max() * (0.02 if weights in (Q4_0, Q4_1) else 0.1)
    assert (logits - expected).abs().max() < scale
    cache = fast.new_cache()  # prefill then decode through the cache: the same numbers
    fast.forward(ids[:, :20], cache, None)
    for position in range(20, 24):
        step = fast.forward(ids[:, position : position + 1], cache, None)
        assert (step - expected[position]).abs().max() < scale


# -- the packed weights kept in the cache folder -------------------------------------------------


def int4_linears(model) -> dict[str, quant.Int4Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, quant.Int4Linear)}


def assert_same_weights(model, reference) -> None:
    linears, expected = int4_linears(model), int4_linears(reference)
    assert linears.keys() == expected.keys() and linears
    for name, linear in linears.items():
        assert torch.equal(linear.packed, expected[name].packed), name
        assert torch.equal(linear.scales_zeros, expected[name].scales_zeros), name
        assert linear.out_features == expected[name].out_features


def packs_for(path: Path, folder: Path) -> PackCache:
    return PackCache(pack_path(folder, path.stem, "key"), path.stem)


@pytest.mark.usefixtures("int4_layouts")
def test_packed_weights_are_kept_and_equal_a_fresh_repack(written, tmp_path):
    _, path = written
    file = GGUFFile(path)
    fresh = fast_builder.build_fast(file)
    first = packs_for(path, tmp_path)
    fast_builder.build_fast(file, packs=first)
    assert first.missed and first.path.is_file()  # nothing stored yet: built, then written
    again = packs_for(path, tmp_path)
    model = fast_builder.build_fast(file, packs=again)
    assert not again.missed  # every int4 weight came from the pack
    assert_same_weights(model, fresh)
    ids = torch.randint(0, 49152, (1, 12))
    torch.testing.assert_close(model.forward(ids, None, None), fresh.forward(ids, None, None))


@pytest.mark.usefixtures("int4_layouts")
def test_a_damaged_pack_is_ignored_and_written_anew(written, tmp_path):
    _, path = written
    file = GGUFFile(path)
    fast_builder.build_fast(file, packs=packs_for(path, tmp_path))
    pack = packs_for(path, tmp_path).path
    pack.write_bytes(pack.read_bytes()[: pack.stat().st_size // 2])  # truncated
    damaged = packs_for(path, tmp_path)
    model = fast_builder.build_fast(file, packs=damaged)
    assert damaged.missed
    assert_same_weights(model, fast_builder.build_fast(file))
    assert packs_for(path, tmp_path).stored.keys() == damaged.entries.keys()  # written anew


@pytest.mark.usefixtures("int4_layouts")
def test_a_pack_entry_that_does_not_fit_is_repacked(written, tmp_path):
    """An entry of the wrong shape (another model's, say) is rebuilt from the file."""
    _, path = written
    file = GGUFFile(path)
    fast_builder.build_fast(file, packs=packs_for(path, tmp_path))
    pack = packs_for(path, tmp_path).path
    entries = torch.load(pack, weights_only=True)
    name = next(iter(entries))
    entries[name]["packed"] = entries[name]["packed"][:, :-1].clone()
    torch.save(entries, pack)
    stale = packs_for(path, tmp_path)
    model = fast_builder.build_fast(file, packs=stale)
    assert stale.missed
    assert_same_weights(model, fast_builder.build_fast(file))


def test_a_pack_is_named_by_the_file_torch_and_format(tmp_path):
    a = pack_path(tmp_path, "model.Q4_1", "aaaa")
    assert a != pack_path(tmp_path, "model.Q4_1", "bbbb")  # another file (or a modified one)
    assert torch.__version__.replace("+", "-") in a.name and a.name.endswith(f"-v{FORMAT}.pt")


@pytest.mark.usefixtures("int4_layouts")
def test_saving_a_pack_removes_only_older_packs_of_the_same_file(written, tmp_path):
    """A new pack replaces the file's older ones (another key, torch or format), and leaves
    the packs of a GGUF whose name only starts with this one's."""
    _, path = written
    older = pack_path(tmp_path, path.stem, "oldkey").with_name(f"{path.stem}-oldkey-torch1.0-v0.pt")
    neighbour = pack_path(tmp_path, f"{path.stem}-b", "key")
    for stale in (older, neighbour):
        stale.write_bytes(b"a pack")
    packs = packs_for(path, tmp_path)
    fast_builder.build_fast(GGUFFile(path), packs=packs)
    assert packs.path.is_file() and neighbour.is_file() and not older.exists()


# -- the probes against an eager forward of the same fast model ----------------------------------


def eager_forward(model, ids: list[int], monkeypatch):
    """Logits at every position and every layer's full attention matrix, from a plain eager
    attention (softmax(q·kᵀ/√d + causal mask)·v in float32) swapped in for SDPA."""
    captured: list[torch.Tensor] = []

    def eager(q, k, v, start):
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1).float()
        v = v.repeat_interleave(groups, dim=1).float()
        scores = q.float() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        n, total = q.shape[2], k.shape[2]
        causal = torch.ones(n, total, dtype=torch.bool).tril(total - n)
        weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        captured.append(weights[0])
        return (weights @ v).to(q.dtype)

    monkeypatch.setattr(engine.model.llama, "attend", eager)
    logits = model.forward(torch.tensor([ids]), None, None, every_position=True)
    monkeypatch.undo()
    return logits, [w.numpy() for w in captured]


def test_fast_attention_and_top_k_equal_an_eager_forward(written, tokenizer, monkeypatch):
    _, path = written
    loaded = fast_loaded(path, tokenizer)
    layers = tuple(range(loaded.info.layers))
    probes = ProbeSettings(attention_layers=layers, top_k=5)
    events = list(ChatSession(loaded).generate(QUESTION, GREEDY, probes))
    prefill, tokens = events[0], [e for e in events if isinstance(e, Token)]
    sequence = [*prefill.prompt_token_ids, *(t.token_id for t in tokens)]
    logits, reference = eager_forward(loaded.model, sequence, monkeypatch)
    n = prefill.prompt_tokens
    qk_norm = loaded.model.shape.architecture == "qwen3"
    atol = QK_NORM_ATTENTION_ATOL if qk_norm else ATTENTION_ATOL
    for layer in layers:
        matrix = prefill.attention[layer]
        assert matrix.shape == (loaded.info.heads, n, n)
        np.testing.assert_allclose(matrix, reference[layer][:, :n, :n], atol=atol)
        for token in tokens[1:]:
            query = n + token.index - 1
            np.testing.assert_allclose(
                token.attention[layer], reference[layer][:, query, : query + 1], atol=atol
            )
    for token in tokens:
        probs = logits[n + token.index - 1].softmax(-1)
        top = probs.topk(5)
        assert [c.token_id for c in token.top_k][:1] == top.indices.tolist()[:1]
        np.testing.assert_allclose([c.prob for c in token.top_k], top.values.numpy(), atol=1e-4)


# -- the cache that grows in place ----------------------------------------------------------------


def test_kv_buffer_grows_in_place_by_chunks_and_truncates():
    cache = KVBuffer(layers=2, kv_heads=2, head_dim=4, dtype=torch.bfloat16,
                     device=torch.device("cpu"), chunk=8)  # fmt: skip
    keys = torch.randn(1, 2, 5, 4).bfloat16()
    cache.reserve(5)
    for layer in range(2):
        cache.write(layer, 0, keys, keys + 1)
    cache.length = 5
    pointer = cache.keys[0].data_ptr()
    assert cache.capacity == 8
    for position in range(5, 8):  # decode steps inside the chunk write in place
        cache.reserve(position + 1)
        step = torch.full((1, 2, 1, 4), float(position)).bfloat16()
        seen_keys, _ = cache.write(0, position, step, step)
        cache.length = position + 1
        assert cache.keys[0].data_ptr() == pointer
        assert seen_keys.shape == (1, 2, position + 1, 4)
        assert seen_keys.data_ptr() == pointer  # a view, not a copy
    cache.reserve(9)  # the next chunk: one copy, the filled part kept
    assert cache.capacity == 16 and cache.keys[0].data_ptr() != pointer
    torch.testing.assert_close(cache.keys[0][:, :, :5], keys)
    torch.testing.assert_close(cache.values[1][:, :, :5], keys + 1)
    per_token = 2 * 2 * 4 * 2  # keys and values, kv heads, head dim, bf16 bytes
    assert cache.layer_bytes() == (8 * per_token, 8 * per_token)
    assert cache.reserved_bytes() == 2 * 16 * per_token
    assert cache.truncate(3) and cache.length == 3
    assert cache.layer_bytes() == (3 * per_token, 3 * per_token)


def test_fast_kv_bytes_are_the_filled_tensors_and_the_formula(written, tokenizer):
    _, path = written
    loaded = fast_loaded(path, tokenizer)
    info = loaded.info
    assert (info.dtype, info.bytes_per_value, info.precision) == ("bfloat16", 2, "fast")
    session = ChatSession(loaded)
    events = list(session.generate(QUESTION, GREEDY, ProbeSettings(top_k=0)))
    _, tokens = assert_kv_bytes_follow_the_formula(events, info)
    cache = session._cache
    filled = sum(
        k[:, :, : cache.length].numel() * k.element_size() * 2 for k in cache.keys
    )  # measured from the tensors the model attends over
    assert tokens[-1].kv_bytes == filled
    assert cache.reserved_bytes() >= filled


def test_fast_decode_writes_the_cache_in_place(written, tokenizer):
    _, path = written
    model = fast_loaded(path, tokenizer).model
    cache = model.new_cache()
    model.forward(torch.randint(0, 49152, (1, 10)), cache, None)
    pointers = [k.data_ptr() for k in cache.keys]
    for _ in range(20):  # well inside the first chunk
        model.forward(torch.randint(0, 49152, (1, 1)), cache, None)
    assert [k.data_ptr() for k in cache.keys] == pointers and cache.length == 30


# -- the session on the bundled model in fast precision --------------------------------------------

TURN = GenerationSettings(greedy=True, max_new_tokens=12)


@pytest.mark.bundled
def test_fast_second_turn_reuses_the_cache_and_answers_as_a_fresh_session(bundled_fast):
    session = ChatSession(bundled_fast)
    first = list(session.generate(QUESTION, TURN))[-1]
    follow_up = [*QUESTION, Message("assistant", first.text), Message("user", "And at sunset?")]
    reused = list(session.generate(follow_up, TURN))
    fresh = list(ChatSession(bundled_fast).generate(follow_up, TURN))
    assert reused[0].reused_tokens > 0 and fresh[0].reused_tokens == 0
    assert [e.token_id for e in reused if isinstance(e, Token)] == [
        e.token_id for e in fresh if isinstance(e, Token)
    ]
    edited = [*QUESTION[:-1], Message("user", "Why is the sea blue? Answer briefly.")]
    cut = list(session.generate(edited, TURN))  # an edited history: cache truncated
    again = list(ChatSession(bundled_fast).generate(edited, TURN))
    assert 0 < cut[0].reused_tokens < cut[0].prompt_tokens
    assert cut[-1].text == again[-1].text


@pytest.mark.bundled
def test_fast_teaching_mode_recomputes_and_holds_no_cache(bundled_fast):
    cached = list(ChatSession(bundled_fast).generate(QUESTION, TURN))
    settings = GenerationSettings(greedy=True, max_new_tokens=12, use_cache=False)
    uncached = list(ChatSession(bundled_fast).generate(QUESTION, settings))
    assert all(e.kv_bytes == 0 for e in uncached if isinstance(e, Token))
    assert cached[-1].text == uncached[-1].text


# -- fast against exact on the bundled model -------------------------------------------------------

TEXT = Path(__file__).with_name("teacher_text.txt")


@pytest.mark.bundled
def test_fast_follows_exact_teacher_forced_over_a_long_text(bundled, bundled_fast):
    """Both models read the same 690-token text; at every position the fast model's next-token
    distribution must agree with the exact one (llama.cpp on such a text: 96.7% top-1 and
    mean |Δp| 0.0046 over the top 10)."""
    ids = bundled.tokenizer(TEXT.read_text())["input_ids"]
    assert len(ids) >= 500
    with torch.inference_mode():
        exact = bundled.model(input_ids=torch.tensor([ids])).logits[0].float().softmax(-1)
    fast = bundled_fast.model.forward(torch.tensor([ids]), None, None, every_position=True)
    fast = fast.softmax(-1)
    agreement = (exact.argmax(-1) == fast.argmax(-1)).float().mean().item()
    top = exact.topk(10, dim=-1).indices
    delta = (exact.gather(1, top) - fast.gather(1, top)).abs().mean().item()
    assert agreement >= 0.97, agreement
    assert delta <= 0.005, delta


def test_fast_decode_steps_follow_exact_teacher_forced(bundled, bundled_fast):
    """The same text one token at a time through the cache, as a reply decodes: the int4
    kernels, the one-position RoPE, norms and attention, against the exact model (measured:
    99.1% top-1, mean |Δp| 0.0011 over the top 10)."""
    agreement, delta, cache = decoded_against_exact(bundled, bundled_fast.model, tokens=520)
    assert cache.length == 520
    assert agreement >= 0.97, agreement
    assert delta <= 0.005, delta


def assert_follows_logits(fast, ids: torch.Tensor, expected: torch.Tensor, scale, prefill: int):
    """`fast` on `ids` within `scale` of the `expected` logits at every position: in one
    pass, then one token at a time through its cache after a prefill of `prefill` tokens.
    Returns that cache."""
    logits = fast.forward(ids, None, None, every_position=True)
    assert (logits - expected).abs().max() < scale
    cache = fast.new_cache()
    fast.forward(ids[:, :prefill], cache, None)
    for position in range(prefill, ids.shape[1]):
        step = fast.forward(ids[:, position : position + 1], cache, None)
        assert (step - expected[position]).abs().max() < scale, position
    return cache


def decoded_against_exact(exact: LoadedModel, model, tokens: int):
    """The fixed text fed one token at a time through `model`'s cache: top-1 agreement with
    the exact model and mean |Δp| over its top 10 at each step, and the cache."""
    ids = exact.tokenizer(TEXT.read_text())["input_ids"][:tokens]
    with torch.inference_mode():
        reference = exact.model(input_ids=torch.tensor([ids])).logits[0].float().softmax(-1)
    cache = model.new_cache()
    steps = [model.forward(torch.tensor([[token]]), cache, None) for token in ids]
    fast = torch.stack(steps).softmax(-1)
    agreement = (reference.argmax(-1) == fast.argmax(-1)).float().mean().item()
    top = reference.topk(10, dim=-1).indices
    delta = (reference.gather(1, top) - fast.gather(1, top)).abs().mean().item()
    return agreement, delta, cache


@pytest.mark.bundled
def test_fast_greedy_decoding_answers_like_exact(bundled, bundled_fast):
    """Prompt through the int4 kernels, then decode steps through the cache: the same reply."""
    question = [Message("user", "What is the capital of France?")]
    settings = GenerationSettings(greedy=True, max_new_tokens=10)
    fast = list(ChatSession(bundled_fast).generate(question, settings))[-1].text
    exact = list(ChatSession(bundled).generate(question, settings))[-1].text
    assert "Paris" in fast and fast == exact


@pytest.mark.parametrize("keys", [40, engine.model.llama.LONG_DECODE_KEYS + 500])  # both its ways
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (12, 2, 128), (4, 4, 32)])
def test_decode_attention_is_sdpas_over_the_whole_cache(keys, heads, kv_heads, head_dim):
    """One query over a cache held in bf16, against SDPA in float32 on the same numbers:
    within a bf16 step of the output (the long way's weights are rounded to bf16)."""
    seeded = torch.Generator().manual_seed(keys)
    q = torch.randn(1, heads, 1, head_dim, generator=seeded).bfloat16()
    k, v = torch.randn(2, 1, kv_heads, keys, head_dim, generator=seeded).bfloat16()
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), enable_gqa=heads != kv_heads
    )
    got = engine.model.llama.decode_attention(q, k, v)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=8e-3)


def assert_kv_bytes_follow_the_formula(events, info):
    """The KV bytes a reply's events report, after the prompt and after each token, are the
    formula's for that many cached positions, and each token's layers add up to its total.
    Returns the prefill event and the Token events."""
    prefill, tokens = events[0], [e for e in events if isinstance(e, Token)]
    assert prefill.kv_bytes == kv_formula.formula_bytes(info, prefill.prompt_tokens)
    for token in tokens:
        cached = prefill.prompt_tokens + token.index
        assert token.kv_bytes == kv_formula.formula_bytes(info, cached)
        assert sum(token.kv_bytes_per_layer) == token.kv_bytes
    return prefill, tokens
