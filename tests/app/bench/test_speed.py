"""The benchmark's llama.cpp peer: a separate process whose failure costs the comparison only."""

from __future__ import annotations

import pytest

from app.bench import llama_cpp_peer
from app.bench import speed as benchmark
from app.bench.llama_cpp_peer import LlamaCppPeer, PeerFailed


def test_a_peer_that_cannot_load_is_reported_not_fatal(tmp_path, monkeypatch):
    """A file llama.cpp cannot read (or llama.cpp missing in the child) ends the peer's
    process; the benchmark gets the reason instead of a crash."""
    monkeypatch.setattr(llama_cpp_peer, "installed", lambda: True)
    peer, note = benchmark._llama_cpp(str(tmp_path / "missing.gguf"), [1, 2, 3])
    assert peer is None
    assert note is not None and note.startswith("could not run here: llama.cpp exited with code")


def test_a_peer_that_dies_raises_peer_failed(tmp_path):
    peer = LlamaCppPeer(str(tmp_path / "missing.gguf"), [1], threads=1)
    peer.process.kill()  # as a segfault in the native library would end it
    with pytest.raises(PeerFailed, match="exited with code"):
        peer.rate(4)
    peer.close()


def test_without_llama_cpp_the_report_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(llama_cpp_peer, "installed", lambda: False)
    assert benchmark._llama_cpp("model.gguf", [1]) == (
        None,
        "not installed (pip install llama-cpp-python to compare)",
    )


def test_each_variant_goes_first_in_turn_and_the_view_on_runs_beside_its_view_off():
    names = ["generate", "engine", "engine_view_on", "fast", "fast_view_on", "fast_sampled"]
    orders = [benchmark.run_order(names, repeat) for repeat in range(8)]
    for order in orders:
        assert sorted(order) == sorted(names)
        for off in ("engine", "fast"):  # a pair shares the machine's state of its moment
            assert abs(order.index(off) - order.index(off + "_view_on")) == 1
    firsts = {order[0].removesuffix("_view_on") for order in orders}
    assert firsts == {"generate", "engine", "fast", "fast_sampled"}  # each in turn
    for off in ("engine", "fast"):  # the view on first in every other repeat
        on_first = [o.index(off + "_view_on") < o.index(off) for o in orders]
        assert on_first == [False, True] * 4
