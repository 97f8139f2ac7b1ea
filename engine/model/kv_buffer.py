"""A KV cache that grows in place: preallocated per layer, written one position at a time.

Each layer holds keys and values [1, kv_heads, capacity, head_dim]. A forward pass writes its
new positions into the free room and attends over a view of the filled part, so a decode step
copies nothing but its own keys and values (transformers' DynamicCache concatenates, copying
the whole cache every step). When the room runs out, every layer grows by whole chunks, once.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 256  # tokens of room added at a time


class KVBuffer:
    # Every position written stays readable (until truncated): a step's keys can be read back
    # after later steps (the view weighs several steps' queries at once)
    keeps_positions = True

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
        # one position's bytes per layer, read from the tensors when they are replaced (the
        # token events ask every step; sixty shape reads a step cost more than the arithmetic)
        self._per_position: tuple[int, ...] | None = None

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
        self._per_position = None

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store keys/values [1, kv_heads, n, head_dim] at positions start..start+n-1; return
        the views `held` gives. Call `reserve(start + n)` before the pass."""
        end = start + keys.shape[2]
        self.keys[layer][:, :, start:end] = keys
        self.values[layer][:, :, start:end] = values
        return self.held(layer, start, end)

    def held(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the keys and values held for the queries at start..end-1: positions
        0..end-1 here."""
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def truncate(self, tokens: int) -> bool:
        """Keep the first `tokens` positions (later writes overwrite the rest)."""
        self.length = min(self.length, tokens)
        return True

    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes of the filled positions of each layer's keys and values: the filled length
        times one position's bytes, read from each tensor's shape and dtype."""
        return tuple(self.length * size for size in self.position_bytes())

    def position_bytes(self) -> tuple[int, ...]:
        """One position's bytes of keys and values in each layer, as the tensors hold them."""
        if self._per_position is None:
            self._per_position = tuple(
                _position_bytes(k) + _position_bytes(v)
                for k, v in zip(self.keys, self.values, strict=True)
            )
        return self._per_position

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


class WindowedKVBuffer(KVBuffer):
    """A KVBuffer whose sliding-window layers keep only what a later query can still see.

    A query at position p on a sliding layer sees positions p - window + 1..p, so once a pass
    is done the next one needs only the last window - 1 positions (it brings its own). Those
    layers' buffers start at `offset`, the position in their slot 0, and hold at most
    window - 1 + 2 chunks: when the room runs out, the last window - 1 positions move to the
    front (one copy per chunk of steps), so their memory no longer grows with the context.
    write() on a sliding layer returns only the positions the pass's queries may see.
    """

    keeps_positions = False  # a sliding layer's old positions leave at a move

    def __init__(self, *args: Any, sliding: tuple[int, ...], window: int, **kwargs: Any) -> None:
        """KVBuffer's arguments, then the sliding layers and their window."""
        super().__init__(*args, **kwargs)
        self.sliding, self.window = frozenset(sliding), window
        self.full = [layer for layer in range(len(self.keys)) if layer not in self.sliding]
        self.offset = 0  # the position held in slot 0 of every sliding layer

    def reserve(self, tokens: int) -> None:
        """Room for positions up to `tokens` - 1 (call it with the pass's start == length)."""
        if self.full and tokens > self.keys[self.full[0]].shape[2]:
            self._move(self.full, slice(0, self.length), -(-tokens // self.chunk) * self.chunk)
        if not self.sliding:
            return
        room = self.keys[min(self.sliding)].shape[2]
        if tokens - self.offset > room:
            keep = max(0, self.length - (self.window - 1))  # the first position still seen
            # a chunk of room beyond what is needed: the next move is a chunk of steps away
            needed = -(-(tokens - keep) // self.chunk) * self.chunk + self.chunk
            held = slice(keep - self.offset, self.length - self.offset)
            self._move(sorted(self.sliding), held, needed)
            self.offset = keep

    def _move(self, layers: list[int], held: slice, capacity: int) -> None:
        """The `held` slots of `layers` into slots 0.. of new buffers of `capacity` slots."""
        for store in (self.keys, self.values):
            for layer in layers:
                grown = self._empty(capacity)
                grown[:, :, : held.stop - held.start] = store[layer][:, :, held]
                store[layer] = grown
        self._per_position = None

    def write(
        self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVBuffer.write; on a sliding layer the views start at the first position the
        pass's first query sees (start - window + 1)."""
        if layer not in self.sliding:
            return super().write(layer, start, keys, values)
        first, end = start - self.offset, start - self.offset + keys.shape[2]
        self.keys[layer][:, :, first:end] = keys
        self.values[layer][:, :, first:end] = values
        return self.held(layer, start, start + keys.shape[2])

    def held(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As KVBuffer.held; on a sliding layer from the first position the query at `start`
        sees (start - window + 1)."""
        if layer not in self.sliding:
            return super().held(layer, start, end)
        seen = max(0, start - (self.window - 1) - self.offset)
        end -= self.offset
        return self.keys[layer][:, :, seen:end], self.values[layer][:, :, seen:end]

    def truncate(self, tokens: int) -> bool:
        """Keep the first `tokens` positions; False where the sliding layers have already
        dropped positions a query after them would see."""
        if tokens < self.length and max(0, tokens - (self.window - 1)) < self.offset:
            return False
        return super().truncate(tokens)

    def held_positions(self) -> tuple[int, ...]:
        """Positions each layer holds for later queries: the last window - 1 on sliding layers."""
        kept = min(self.length, self.window - 1)
        return tuple(kept if i in self.sliding else self.length for i in range(len(self.keys)))

    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes of the positions each layer holds for later queries, one position's bytes read
        from each tensor's shape and dtype (a sliding layer's spare room is reserved_bytes)."""
        return tuple(
            held * size
            for held, size in zip(self.held_positions(), self.position_bytes(), strict=True)
        )
