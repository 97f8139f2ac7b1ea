"""What moving weights costs, measured where it happens: in accelerate's hooks.

An offloaded module's `AlignDevicesHook.pre_forward` reads its weights from the offload map
(RAM, or a memory-mapped file on disk) and copies them to the executing device before the
module runs; its post_forward drops them again. The meter wraps both halves of that:
- the map, so every tensor read is counted (the bytes actually brought in);
- pre_forward, timed: host clock on the CPU, CUDA events on a GPU (where the copy is queued).
Only hooks that offload are wrapped; a model wholly in place never gets a meter.

What a step will cost is measured the same way, at load: `probe` runs one-token forward passes
through the metered hooks, as decode does. Reading all the weights in by hand instead (a loop
over the offload map) read at speeds far from the steps' own on the same files, higher or
lower as the allocator's and the kernel's pages stood; the passes meet what the steps meet.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from engine.measure.device import synchronize


class CountedWeights(Mapping[str, torch.Tensor]):
    """An offload map that adds the bytes of every tensor read to its meter."""

    def __init__(self, inner: Mapping[str, torch.Tensor], meter: TransferMeter) -> None:
        self.inner = inner
        self.meter = meter

    def __getitem__(self, key: str) -> torch.Tensor:
        tensor = self.inner[key]
        self.meter.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __iter__(self) -> Iterator[str]:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


@dataclass(frozen=True, slots=True)
class PassCost:
    """What one metered forward pass took: the bytes its hooks read in, the seconds spent
    reading them, and the pass's whole time."""

    bytes: int
    transfer_s: float
    seconds: float

    @property
    def read_bytes_per_s(self) -> float:
        return self.bytes / self.transfer_s if self.transfer_s > 0 else 0.0

    @property
    def compute_s(self) -> float:
        return max(self.seconds - self.transfer_s, 0.0)


class TransferMeter:
    """Counts and times the weights a model's offloading hooks bring in, pass by pass:
    `begin()` before a pass, `take()` after it -> (bytes, seconds)."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        self.bytes = 0
        self.seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.hooks = [(m, hook) for m in model.modules() for hook in offloading_hooks(m)]
        for _module, hook in self.hooks:
            hook.weights_map = CountedWeights(hook.weights_map, self)
            hook.pre_forward = self._timed(hook.pre_forward)

    def begin(self) -> None:
        self.bytes, self.seconds, self._events = 0, 0.0, []

    def take(self) -> tuple[int, float]:
        """The bytes read and the seconds spent loading them since `begin()`."""
        if self._events:
            self._events[-1][1].synchronize()
            self.seconds += sum(a.elapsed_time(b) for a, b in self._events) / 1000
            self._events = []
        return self.bytes, self.seconds

    def predicted_s(self) -> None:
        """None: every pass moves the same bytes (the placement's prediction holds)."""
        return None

    def _timed(self, pre_forward: Callable[..., Any]) -> Callable[..., Any]:
        if self.device.type == "cuda":
            return self._cuda_timed(pre_forward)

        def timed(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return pre_forward(module, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def _cuda_timed(self, pre_forward: Callable[..., Any]) -> Callable[..., Any]:
        def timed(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            try:
                return pre_forward(module, *args, **kwargs)
            finally:
                end.record()
                self._events.append((start, end))

        return timed


def offloading_hooks(module: torch.nn.Module) -> list[Any]:
    """The module's accelerate hooks that bring weights in before it runs."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    inner = getattr(hook, "hooks", None) or (hook,)  # a SequentialHook holds several
    return [h for h in inner if getattr(h, "offload", False) and getattr(h, "weights_map", None)]


def probe(
    model: torch.nn.Module, meter: TransferMeter, device: torch.device, budget_s: float = 1.0,
    most: int = 3,
) -> PassCost:  # fmt: skip
    """The fastest of up to `most` one-token forward passes (no cache), metered as a decode
    step is. The first pass may meet a cold allocator and offload files still being written;
    later ones run while the passes so far took less than `budget_s` in all, so a model whose
    pass reads gigabytes from a slow disk pays for one pass at load, not three."""
    ids = torch.zeros((1, 1), dtype=torch.long, device=device)
    passes: list[PassCost] = []
    for _ in range(most):
        passes.append(_metered_pass(model, meter, ids, device))
        if sum(cost.seconds for cost in passes) >= budget_s:
            break
    meter.begin()
    return min(passes, key=lambda cost: cost.seconds)


def _metered_pass(
    model: torch.nn.Module, meter: TransferMeter, ids: torch.Tensor, device: torch.device
) -> PassCost:
    meter.begin()
    start = time.perf_counter()
    with torch.inference_mode():
        model(input_ids=ids, use_cache=False)
    synchronize(device)
    seconds = time.perf_counter() - start
    moved, transfer_s = meter.take()
    return PassCost(moved, transfer_s, seconds)
