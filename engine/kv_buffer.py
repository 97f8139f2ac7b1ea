"""A KV cache that grows in place: preallocated per layer, written one position at a time.

Each layer holds keys and values [1, kv_heads, capacity, head_dim]. A forward pass writes its
new positions into the free room and attends over a view of the filled part, so a decode step
copies nothing but its own keys and values (transformers' DynamicCache concatenates, copying
the whole cache every step). When the room runs out, every layer grows by whole chunks, once.
"""

from __future__ import annotations

import torch

CHUNK = 256  # tokens of room added at a time


class KVBuffer:
    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        chunk: int = CHUNK,
    ) -> None:
        self.shape = (1, kv_heads, 0, head_dim)
        self.dtype, self.device, self.chunk = dtype, device, chunk
        self.keys: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.values: list[torch.Tensor] = [self._empty(0) for _ in range(layers)]
        self.length = 0  # positions filled (the same in every layer)

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` positions in every layer (whole chunks; filled part kept)."""
        if tokens <= self.capacity:
            return
        capacity = -(-tokens // self.chunk) * self.chunk
        for store in (self.keys, self.values):
            for layer, old in enumerate(store):
                grown = self._empty(capacity)
                grown[:, :, : self.length] = old[:, :, : self.length]
                store[layer] = grown

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, kv_heads, n, head_dim] at positions start..start+n-1; return
        views of positions 0..start+n-1. Call `reserve(start + n)` before the pass."""
        end = start + keys.shape[2]
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def truncate(self, tokens: int) -> bool:
        """Keep the first `tokens` positions (later writes overwrite the rest)."""
        self.length = min(self.length, tokens)
        return True

    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes of the filled positions of each layer's keys and values: the filled length
        times one position's bytes, read from each tensor's shape and dtype."""
        return tuple(
            self.length * (_position_bytes(k) + _position_bytes(v))
            for k, v in zip(self.keys, self.values, strict=True)
        )

    def reserved_bytes(self) -> int:
        """Bytes allocated, filled or not (the filled part plus the room for the next chunk)."""
        return sum(_nbytes(t) for t in (*self.keys, *self.values))

    def _empty(self, capacity: int) -> torch.Tensor:
        shape = (*self.shape[:2], capacity, self.shape[3])
        return torch.empty(shape, dtype=self.dtype, device=self.device)


def _position_bytes(tensor: torch.Tensor) -> int:
    """Bytes one position takes in a [1, kv_heads, capacity, head_dim] tensor."""
    return tensor.shape[0] * tensor.shape[1] * tensor.shape[3] * tensor.element_size()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
