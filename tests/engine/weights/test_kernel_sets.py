"""The int4 layouts under each of torch's CPU kernel sets: the packed bytes the kernel reads
differ between AVX-512 (blocks of 64 rows) and AVX2 (32), and a weight packed for one
multiplies to garbage under the other. torch picks the set once per process
($ATEN_CPU_CAPABILITY), so each set is checked in a process of its own."""

from __future__ import annotations

import pytest

from tests.kernel_sets import KERNEL_SETS, report_under

CHILD = """
import json, gguf, numpy as np, torch
from engine.weights import linear as quant

values = np.random.default_rng(0).standard_normal((160, 256), dtype=np.float32)
blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)
weights = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_0))
raw = torch.from_numpy(blocks)  # 160 rows: whole blocks of 32, not of 64
errors = {}
for rows in (1, 80):  # a decode step (the kernel) and a prefill (unpacked to bf16)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
    linear = quant.Int4Linear.from_blocks(raw, 2, torch.bfloat16)
    expected = x @ weights.t()
    got = linear.forward(x.bfloat16()).float()
    errors[rows] = ((got - expected).abs().max() / expected.abs().max()).item()
print(json.dumps({"set": torch.backends.cpu.get_cpu_capability(),
                  "block": quant.kernel_block_rows(), "errors": errors}))
"""


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_int4_weights_multiply_right_under_each_kernel_set(kernel_set):
    report = report_under(kernel_set, CHILD)
    # a CPU without AVX-512 runs its best set instead: the layout must follow what runs
    expected_block = {"AVX512": 64, "AVX2": 32}.get(report["set"])
    assert report["block"] == expected_block, report
    assert max(report["errors"].values()) < 0.02, report  # bf16 rounding, not garbage
