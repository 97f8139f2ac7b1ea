"""What watching the logit lens costs the bundled model's fast decode (docs/lens.md).

    python scripts/lens_speed.py replies [TOKENS] [REPEATS]
        decode tok/s with the lens watched and not, interleaved, through the compiled step
        (built first if it is not kept); how many steps of a watched reply went through it;
        one kept step's lens in ms.
    python scripts/lens_speed.py step OLD.pt2 NEW.pt2 [ROUNDS]
        two compiled step packages of the bundled model (say, of two STEP_VERSIONs) called
        alone on the same inputs, interleaved: ms a step, wall and CPU.

Run from the repository root with GLASSBOX_CACHE_DIR set as for the app.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from engine.events import Finished
from engine.generate.session import ChatSession
from engine.load.loader import load_model
from engine.settings import GenerationSettings, LoadRequest, Message, ProbeSettings
from engine.step import compiled
from engine.step.flat import step_positions


def replies(tokens: int = 64, repeats: int = 5) -> None:
    loaded = load_model(LoadRequest(spec="bundled", device="cpu", precision="fast"))
    if loaded.compiling is not None:
        loaded.compiling.done.wait()
        print("decode step:", loaded.compiling.state)
    session, model = ChatSession(loaded), loaded.model
    settings = GenerationSettings(
        greedy=True, completion=True, max_new_tokens=tokens, ignore_eos=True
    )

    def rate(watch: bool) -> float:
        session.watch_lens(watch)
        events = session.generate([Message("user", "Today's weather is so")], settings,
                                  ProbeSettings())  # fmt: skip
        return next(e for e in events if isinstance(e, Finished)).decode_tokens_per_s

    rate(False), rate(True)  # warm
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(repeats):
        for watch in rates:
            rates[watch].append(rate(watch))
    for watch, values in rates.items():
        print(f"watched={watch}: median {statistics.median(values):.1f} tok/s, all {values}")
    step, calls = model.decode_step, [0]

    def counted(*args: object) -> object:
        calls[0] += 1
        return step(*args)

    model.decode_step = counted
    rate(True)
    model.decode_step = step
    print(f"compiled step calls in a watched reply of {tokens} tokens: {calls[0]}")
    times = []
    for index in range(min(tokens, 24)):
        start = time.perf_counter()
        assert session.layer_lens(index) is not None
        times.append((time.perf_counter() - start) * 1e3)
    print(f"one step's lens: median {statistics.median(times):.1f} ms, max {max(times):.1f}")


@torch.no_grad()
def steps(old: str, new: str, rounds: int = 40, batch: int = 20) -> None:
    model = load_model(LoadRequest(spec="bundled", device="cpu", precision="fast",
                                   compiled=False)).model  # fmt: skip
    loader = compiled._package_loader()
    runners = {path: loader(path, "model", False, 1, -1) for path in (old, new)}
    cache = model.new_cache()
    model.forward(torch.arange(3, 203)[None], cache, None)  # 200 positions
    cache.reserve(cache.length + 2)
    ropes = [t for rope in model.ropes(cache.length, 1) for t in rope.tensors()]
    positions = step_positions(cache.length, cache, 0)
    weights = [t for layer in compiled.layer_weights(model) for t in layer]
    eps = torch.full((1, 1), model.shape.eps)
    flat = [torch.randn(1, model.shape.dim), *ropes, *positions, eps, *weights,
            *cache.keys, *cache.values]  # fmt: skip
    wall: dict[str, list[float]] = {path: [] for path in runners}
    cpu: dict[str, list[float]] = {path: [] for path in runners}
    for _ in range(rounds):
        for path, runner in runners.items():
            started, used = time.perf_counter(), time.process_time()
            for _ in range(batch):
                runner.run(flat)
            wall[path].append((time.perf_counter() - started) * 1e3 / batch)
            cpu[path].append((time.process_time() - used) * 1e3 / batch)
    for name, measured in (("wall", wall), ("cpu", cpu)):
        for path, values in measured.items():
            median = statistics.median(values)
            print(f"{name} {path}: median {median:.3f} ms, min {min(values):.3f}")
        ratio = statistics.median(measured[new]) / statistics.median(measured[old])
        least = min(measured[new]) / min(measured[old])
        print(f"{name} new / old: median {ratio:.4f}, min {least:.4f}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["replies"]:
        replies(*(int(a) for a in sys.argv[2:4]))
    elif sys.argv[1:2] == ["step"]:
        steps(sys.argv[2], sys.argv[3], *(int(a) for a in sys.argv[4:5]))
    else:
        sys.exit(__doc__)
