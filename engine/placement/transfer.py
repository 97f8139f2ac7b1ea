"""What moving weights costs, measured where it happens: in accelerate's hooks.

An offloaded module's `AlignDevicesHook.pre_forward` reads its weights from the offload map
(RAM, or a memory-mapped file on disk) and copies them to the executing device before the
module runs; its post_forward drops them again. The meter wraps both halves of that:
- the map, so every tensor read is counted (the bytes actually brought in);
- pre_forward, timed: host clock on the CPU, CUDA events on a GPU (where the copy is queued).
Only hooks that offload are wrapped; a model wholly in place never gets a meter.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch


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

    def read_bytes_per_s(self, repeats: int = 3) -> float:
        """How fast the offloaded weights are read in, as the hooks read them: the best of
        `repeats` reads of all of them (the first may still wait on the files' writing)."""
        best = 0.0
        for _ in range(repeats):
            read, seconds = self.read_all()
            best = max(best, read / seconds if seconds > 0 else 0.0)
        return best

    def read_all(self) -> tuple[int, float]:
        """Read every offloaded weight once, as the hooks do (not counted): (bytes, seconds)."""
        from accelerate.utils import named_module_tensors

        total, start = 0, time.perf_counter()
        for module, hook in self.hooks:
            inner = hook.weights_map.inner
            for name, _ in named_module_tensors(
                module, hook.offload_buffers, hook.place_submodules, remove_non_persistent=True
            ):
                tensor = inner[name].to(self.device)
                total += tensor.numel() * tensor.element_size()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return total, time.perf_counter() - start

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
