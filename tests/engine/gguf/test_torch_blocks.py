"""The torch dequantiser (engine/gguf/torch_blocks.py) equals the numpy one (blocks.py, itself
held to gguf's reference) bit for bit, on every type, on the CPU here (on a GPU through
`make gpu-check`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.gguf import blocks, torch_blocks
from tests.engine.measure.test_accelerator import DEVICES

# where each type keeps its f16 fields (d, and m or dmin): filled with sane values, the rest
# of every block random bytes
F16_AT = {
    blocks.Q4_0: (0,),
    blocks.Q4_1: (0, 2),
    blocks.Q5_0: (0,),
    blocks.Q5_1: (0, 2),
    blocks.Q8_0: (0,),
    blocks.Q4_K: (0, 2),
    blocks.Q5_K: (0, 2),
    blocks.Q6_K: (208,),
}


def random_blocks(qtype: int, rows: int = 24, per_row: int = 3, seed: int = 0) -> torch.Tensor:
    generator = np.random.default_rng(seed)
    size = blocks.BLOCK_BYTES[qtype]
    raw = generator.integers(0, 256, (rows, per_row, size), dtype=np.uint8)
    for start in F16_AT[qtype]:
        f16 = (generator.standard_normal((rows, per_row)) * 0.01).astype(np.float16)
        raw[..., start : start + 2] = f16[..., None].view(np.uint8).reshape(rows, per_row, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("device", [d for d in DEVICES if d != "mps"])
@pytest.mark.parametrize("qtype", list(F16_AT))
def test_every_type_dequantises_as_the_numpy_reference(qtype, device):
    raw = random_blocks(qtype)
    want = blocks.dequantize(raw, qtype)
    got = torch_blocks.dequantize(raw.to(device), qtype).cpu()
    assert got.shape == want.shape and got.dtype == torch.float32
    assert torch.equal(got, want)
    bf16 = torch_blocks.dequantize(raw.to(device), qtype, torch.bfloat16).cpu()
    assert torch.equal(bf16, want.to(torch.bfloat16))


def test_a_type_it_does_not_read_is_refused():
    with pytest.raises(ValueError, match="ggml type 10"):
        torch_blocks.dequantize(torch.zeros(2, 84, dtype=torch.uint8), 10)  # Q2_K
