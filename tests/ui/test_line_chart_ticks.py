"""The painted charts' ticks: 1, 2 or 5 times a power of ten, whole numbers on an axis of
counts (a reply of two tokens has no token 0.5)."""

from __future__ import annotations

import numpy as np
import pytest

from ui.panels.line_chart import nice_ticks


@pytest.mark.parametrize(
    ("limit", "whole", "expected"),
    [
        (2.5, False, [0, 0.5, 1, 1.5, 2, 2.5]),
        (2.5, True, [0, 1, 2]),
        (1.0, True, [0, 1]),
        (1000, True, [0, 200, 400, 600, 800, 1000]),
        (0.004, False, [0, 0.001, 0.002, 0.003, 0.004]),
    ],
)
def test_ticks(limit, whole, expected):
    np.testing.assert_allclose(nice_ticks(limit, 5, whole=whole), expected)
