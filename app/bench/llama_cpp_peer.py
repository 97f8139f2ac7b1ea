"""llama.cpp on the same GGUF, as a peer for `glassbox bench`, in a process of its own.

`llama_cpp` (llama-cpp-python) is optional and never a dependency. Its native library can
crash the interpreter (a build whose CPU paths this machine or VM refuses ends in a
segfault inside llama_decode), and it brings its own OpenMP runtime; so it runs in a child
process that the benchmark asks for one decode rate at a time over a pipe. A crash there
costs the comparison, reported as such, never the benchmark.

    python -m app.bench.llama_cpp_peer GGUF THREADS PROMPT_IDS_JSON
    stdin: a number of new tokens per line -> stdout: the decode tokens/s of that reply and
           its time to first token; or `prefill IDS_JSON` -> stdout: the seconds one prefill
           of those ids took
"""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import time
from typing import Any


class PeerFailed(RuntimeError):
    """The llama.cpp process could not load the model or died during a run."""


class LlamaCppPeer:
    """A running llama.cpp process holding the model; `rate(n)` times one greedy reply."""

    def __init__(self, path: str, prompt: list[int], threads: int) -> None:
        self.last_ttft_s = 0.0  # the last reply's time to first token (`rate`)
        command = [sys.executable, "-m", __name__, path, str(threads), json.dumps(prompt)]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True,
        )  # fmt: skip

    def rate(self, new_tokens: int) -> float:
        """Decode tokens/s of a reply of `new_tokens` (greedy, never ending early)."""
        rate, self.last_ttft_s = self._ask(str(new_tokens))
        return rate

    def prefill_rate(self, ids: list[int]) -> float:
        """Tokens/s of one prefill of `ids` into an empty cache (the prompt's pass alone)."""
        return len(ids) / self._ask(f"prefill {json.dumps(ids)}")[0]

    def _ask(self, request: str) -> list[float]:
        stdin, stdout = self.process.stdin, self.process.stdout
        assert stdin is not None and stdout is not None  # both are pipes
        try:
            stdin.write(f"{request}\n")
            stdin.flush()
            line = stdout.readline()
        except OSError:  # the pipe broke: the process is gone
            line = ""
        if not line:
            raise PeerFailed(f"llama.cpp exited with code {_exit_name(self.process.wait())}")
        return [float(word) for word in line.split()]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _exit_name(code: int) -> str:
    """An exit code, with the signal's name when a signal ended the process (-11: SIGSEGV)."""
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)


def installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _serve(path: str, threads: int, prompt: list[int]) -> None:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip
    # greedy, and never ending early (as min_new_tokens does for generate): every
    # end-of-generation token is barred, not only the EOS (SmolLM2 has two)
    barred = {t: -1e9 for t in range(llm.n_vocab()) if _ends(llama_cpp, llm, t)}

    def decode_rate(n: int) -> tuple[float, float]:
        """Tokens/s from the first token's arrival to the last's (decode alone, in wall time),
        and the seconds to the first token (the prompt's pass and the first sample)."""
        llm.reset()
        start = time.perf_counter()
        stream = llm.create_completion(prompt, max_tokens=n, temperature=0.0, top_k=1,
                                       logit_bias=barred, stream=True)  # fmt: skip
        arrivals = [time.perf_counter() for _ in stream]
        rate = (len(arrivals) - 1) / max(arrivals[-1] - arrivals[0], 1e-9)
        return rate, arrivals[0] - start

    def prefill_seconds(ids: list[int]) -> float:
        """One pass of `ids` through an empty cache, as the engine's prefill is timed."""
        llm.reset()
        start = time.perf_counter()
        llm.eval(ids)
        return time.perf_counter() - start

    for line in sys.stdin:
        command, _, argument = line.partition(" ")
        if command == "prefill":
            print(prefill_seconds(json.loads(argument)), flush=True)
        else:
            print(*decode_rate(int(line)), flush=True)


def _ends(llama_cpp: Any, llm: Any, token: int) -> bool:
    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]))
