"""A prompt's attention through torch's kernel, in bf16 wherever that kernel runs.

On a CPU with AMX or AVX-512 BF16, torch's flash attention packs the blocks of a bf16 prompt
(64 queries or more) with AVX-512 instructions whenever the hardware has them, also where a
lower kernel set is forced (`ATEN_CPU_CAPABILITY=avx2` or `default`), and there it raises
"pack_vnni2 is only supported when avx512 is supported". Whether it runs is checked once per
process on a small prompt; where it does not, prompts attend on float32 copies (the same
weights, rounded once less) and the log says so.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CHECK_QUERIES = 64  # the fewest queries that take the packed path


@functools.cache
def bf16_runs_on_cpu() -> bool:
    """Whether torch's CPU attention takes a bf16 prompt under the kernel set in use."""
    q = torch.zeros(1, 1, CHECK_QUERIES, 64, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    except RuntimeError as error:
        log.info(
            "torch's bf16 attention does not run under the %s kernel set here (%s): prompts "
            "attend in float32",
            torch.backends.cpu.get_cpu_capability(),
            error,
        )
        return False
    return True


def in_float32_here(q: torch.Tensor) -> bool:
    """Whether attention over `q` must run on float32 copies (see the module's docstring)."""
    return q.dtype == torch.bfloat16 and q.device.type == "cpu" and not bf16_runs_on_cpu()


def prompt_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **options: Any
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, **options)` in q's dtype, computed on float32
    copies where torch's bf16 kernel does not run on this CPU."""
    if in_float32_here(q):
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **options)
        return y.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, **options)
