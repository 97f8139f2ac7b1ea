"""A numpy buffer that grows by appends without copying on every one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class GrowableArray:
    """A numpy array with amortized O(1) appends: it doubles its capacity when full.

    `width=None` holds scalars (shape [n]); an int holds rows of that width (shape [n, width]).
    """

    def __init__(
        self, dtype: type | np.dtype = np.float64, width: int | None = None, capacity: int = 256
    ) -> None:
        self._width = width
        shape = (capacity,) if width is None else (capacity, width)
        self._data = np.zeros(shape, dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    @property
    def capacity(self) -> int:
        return self._data.shape[0]

    @property
    def width(self) -> int | None:
        return self._width

    def append(self, value: float | Sequence[float] | np.ndarray) -> None:
        if self._size == self._data.shape[0]:
            self._grow()
        self._data[self._size] = value
        self._size += 1

    def view(self) -> np.ndarray:
        """The filled part, without copying (valid until the next append grows the buffer)."""
        return self._data[: self._size]

    def last(self) -> np.ndarray | float:
        if not self._size:
            raise IndexError("empty buffer")
        value: np.ndarray | float = self._data[self._size - 1]
        return value

    def set_last(self, value: float | Sequence[float] | np.ndarray) -> None:
        if not self._size:
            raise IndexError("empty buffer")
        self._data[self._size - 1] = value

    def _grow(self) -> None:
        bigger = np.zeros((self._data.shape[0] * 2, *self._data.shape[1:]), self._data.dtype)
        bigger[: self._size] = self._data[: self._size]
        self._data = bigger
