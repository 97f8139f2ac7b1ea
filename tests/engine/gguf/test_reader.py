"""A GGUF cut short anywhere, or with its bytes damaged, is refused with GGUFError (which the
loader turns into "not a readable GGUF model"), never with another exception."""

from __future__ import annotations

import numpy as np
import pytest

from engine.gguf.reader import GGUFError, GGUFFile


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    """Metadata of every kind a model's file holds (a vocabulary's strings, scores and types)
    and two small tensors."""
    import gguf

    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_name("small")
    writer.add_token_list([f"token{i}" for i in range(64)])
    writer.add_token_scores([float(i) for i in range(64)])
    writer.add_token_types([1] * 64)
    writer.add_tensor("a.weight", np.arange(32, dtype=np.float32).reshape(4, 8))
    writer.add_tensor("b.weight", np.ones(16, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_the_whole_file_reads(small_gguf):
    file = GGUFFile(small_gguf)
    assert file.get("tokenizer.ggml.tokens")[63] == "token63"
    assert file.get("tokenizer.ggml.scores")[63] == 63.0
    assert np.array_equal(file.raw("a.weight").view(np.float32).reshape(-1), np.arange(32))
    file.close()


def test_a_file_cut_at_any_byte_is_a_gguf_error(small_gguf, tmp_path):
    """Every length short of the whole file: inside the header, a string, the numeric arrays
    (the scores: numpy's read past the end raised a bare ValueError) and the tensors."""
    whole = small_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    refusals = set()
    for length in range(len(whole)):
        cut.write_bytes(whole[:length])
        try:
            GGUFFile(cut)
        except GGUFError as error:
            refusals.add(str(error).split(" (")[0])
        else:
            pytest.fail(f"a file cut to {length} of {len(whole)} bytes was read")
    assert {"the file is empty", "a metadata array runs past the end of the file"} <= refusals


def test_damaged_bytes_are_a_gguf_error_or_read(small_gguf, tmp_path):
    """Each byte of the header set to 0xFF in turn: refused clearly or read (a changed value),
    never another exception."""
    whole = bytearray(small_gguf.read_bytes())
    header = GGUFFile(small_gguf).tensors["a.weight"].offset
    damaged = tmp_path / "damaged.gguf"
    refused = 0
    for at in range(header):
        changed = whole.copy()
        changed[at] = 0xFF
        damaged.write_bytes(changed)
        try:
            GGUFFile(damaged).close()
        except GGUFError:
            refused += 1
    assert 0 < refused < header  # the magic, counts and lengths are refused; a name's byte reads


def test_a_tensor_type_it_does_not_read_is_named_with_the_types_it_does(small_gguf, tmp_path):
    """An IQ4_XS file (type 23): the message names the type and the files that do read."""
    whole = bytearray(small_gguf.read_bytes())
    file = GGUFFile(small_gguf)
    info = file.tensors["b.weight"]
    file.close()
    name = b"b.weight"
    at = whole.index(name) + len(name) + 4 + 8 * len(info.shape)  # after its dims: its type
    assert int.from_bytes(whole[at : at + 4], "little") == info.type
    whole[at : at + 4] = (23).to_bytes(4, "little")
    other = tmp_path / "iq4_xs.gguf"
    other.write_bytes(whole)
    with pytest.raises(GGUFError, match=r"b\.weight is IQ4_XS \(ggml type 23\).*Q4_K, .*Q4_K_M"):
        GGUFFile(other)
