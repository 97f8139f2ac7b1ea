"""Random GGML blocks: a quantised weight of the right type and size without quantising one.

Quantising a 262,144-row embedding in numpy takes minutes, and K-quants cannot be quantised
by the `gguf` package at all; random bytes are valid blocks of every type. Only the f16 scale
fields are set, so that the weights come out about `std` in size (a random scale would give
weights up to 65,504 and infinities in the activations).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from engine.gguf.blocks import BLOCK_BYTES, BLOCK_VALUES, Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, Q6_K, Q8_0

# Per type: (byte offset of an f16 field, its value as a multiple of std) for each field.
# The divisors are the spread of a block's random quants times its random sub-scales: Q8_0's
# int8 quants spread ~74, Q4_0's centred nibbles ~4.6, Q5_0's ~9.2, Q4_1's nibbles with their
# minimum at -7.5 steps; a K-quant's 6-bit sub-scales multiply its super-scale.
SCALE_FIELDS: dict[int, tuple[tuple[int, float], ...]] = {
    Q8_0: ((0, 1 / 74),),
    Q4_0: ((0, 1 / 4.6),),
    Q5_0: ((0, 1 / 9.2),),
    Q4_1: ((0, 1 / 4.6), (2, -7.5 / 4.6)),
    Q4_K: ((0, 1 / 200), (2, 1 / 200)),
    Q5_K: ((0, 1 / 400), (2, 1 / 400)),
    Q6_K: ((208, 1 / 1000),),
}


def random_blocks(
    rows: int, columns: int, qtype: int, std: float, seed: int = 0
) -> npt.NDArray[np.uint8]:
    """Random `qtype` blocks for a [rows, columns] weight, as uint8 [rows, row bytes]."""
    if qtype not in SCALE_FIELDS:
        raise ValueError(f"no random blocks for GGML type {qtype}")
    shape = (rows, columns // BLOCK_VALUES[qtype], BLOCK_BYTES[qtype])
    raw = np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)
    for at, factor in SCALE_FIELDS[qtype]:
        field = np.full((*shape[:2], 1), std * factor, np.float16)
        raw[..., at : at + 2] = field.view(np.uint8)
    return raw.reshape(rows, -1)
