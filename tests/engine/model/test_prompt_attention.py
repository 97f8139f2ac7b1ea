"""A bf16 prompt's attention under every CPU kernel set: on a CPU with AMX or AVX-512 BF16,
torch's bf16 kernel raised for prompts of 64 tokens or more under a forced lower set
(ATEN_CPU_CAPABILITY=avx2 or default). torch picks the set once per process, so each set runs
in a process of its own; the float32 fallback is checked in this one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.model import attention_probe, prompt_attention
from engine.model.gemma import attend_window
from engine.model.llama import attend
from tests.kernel_sets import KERNEL_SETS, report_under

CHILD = """
import json, torch
from engine.model.gemma import attend_window
from engine.model.llama import attend

g = torch.Generator().manual_seed(0)
q = torch.randn(1, 9, 100, 64, generator=g)
k, v = torch.randn(2, 1, 3, 100, 64, generator=g)
mask = torch.arange(100)[None, :] <= torch.arange(100)[:, None]
reference = torch.nn.functional.scaled_dot_product_attention(
    q.double(), k.double(), v.double(), attn_mask=mask, enable_gqa=True)
bf16 = [t.bfloat16() for t in (q, k, v)]
got = {"llama": attend(*bf16, 0), "gemma": attend_window(*bf16, 0, None, 64 ** -0.5)}
errors = {name: (y.double() - reference).abs().max().item() for name, y in got.items()}
print(json.dumps({"set": torch.backends.cpu.get_cpu_capability(), "errors": errors,
                  "dtypes": sorted({str(y.dtype) for y in got.values()})}))
"""


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_a_bf16_prompt_attends_under_each_kernel_set(kernel_set):
    report = report_under(kernel_set, CHILD)
    assert report["dtypes"] == ["torch.bfloat16"], report
    # bf16 inputs and output: a few hundredths at most on weights averaging unit vectors
    assert max(report["errors"].values()) < 0.05, report


@pytest.fixture
def bf16_fails(monkeypatch):
    """As on a CPU whose bf16 kernel raises under the kernel set in use."""
    monkeypatch.setattr(prompt_attention, "bf16_runs_on_cpu", lambda: False)


def _prompt(n: int = 80) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    q = torch.randn(1, 6, n, 32, generator=g).bfloat16()
    k, v = torch.randn(2, 1, 2, n, 32, generator=g).bfloat16()
    return q, k, v


def test_where_bf16_fails_prompts_attend_on_float32_copies(bf16_fails):
    q, k, v = _prompt()
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    ).bfloat16()
    got = attend(q, k, v, 0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    window = attend_window(q, k, v, 0, 16, 32**-0.5)  # a sliding layer's mask, in float32 too
    assert window.dtype == torch.bfloat16 and torch.isfinite(window.float()).all()


def test_the_exact_path_attends_on_float32_copies_where_bf16_fails(bf16_fails):
    q, k, v = _prompt()
    mask = torch.zeros(1, 1, 80, 80, dtype=torch.bfloat16)  # additive, in the model's dtype
    mask.masked_fill_(torch.ones(80, 80, dtype=torch.bool).triu(1), float("-inf"))
    module = SimpleNamespace(num_key_value_groups=3, is_causal=True, training=False)
    output, _ = attention_probe.glassbox_attention(module, q, k, v, mask, scaling=32**-0.5)
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask.float(), enable_gqa=True
    )
    assert output.dtype == torch.bfloat16
    assert torch.equal(output, expected.transpose(1, 2).bfloat16())  # float32, rounded once


def test_the_check_runs_once_and_says_what_this_cpu_does():
    prompt_attention.bf16_runs_on_cpu.cache_clear()
    first = prompt_attention.bf16_runs_on_cpu()
    assert prompt_attention.bf16_runs_on_cpu.cache_info().hits == 0
    assert prompt_attention.bf16_runs_on_cpu() is first
    assert prompt_attention.bf16_runs_on_cpu.cache_info().hits == 1
    q = torch.zeros(1, 1, prompt_attention.CHECK_QUERIES, 64, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        runs = True
    except RuntimeError:
        runs = False
    assert first is runs
