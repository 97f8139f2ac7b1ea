"""The GGML kernels (kernels/ggml_dot.cpp): built once per machine, loaded as torch ops.

torch's CPU int4 kernel widens every weight to floats, which bounds how fast it reads weights
under AVX2, and a Q6_K weight has to be held in 1.25 bytes a value to fit it. The kernels here
multiply the file's own blocks with integer dot products, as llama.cpp does, on activations
rounded in two int8 terms (ggml_dot.cpp's Q8): faster than torch's kernels under AVX2 and
AVX-512 alike, with the weight at its file size.

They are compiled with the C++ compiler the compiled decode step already needs, into the
cache folder, keyed by the sources, torch and the flags, in one of two forms (`kernel_set`):
AVX2's, or AVX-512 VNNI's where torch runs its AVX-512 kernels on a CPU that has it (the same
integer sums in fewer instructions: on Qwen2.5-1.5B's and Gemma-3-270M's weights their
products take 6-12% less time). One build at a time
(engine/disk/build_lock.py). Where they cannot run (no compiler, a CPU without AVX2, torch's
kernel set forced to DEFAULT) `ensure()` says why, and the weights take torch's int4 kernel;
$GLASSBOX_GGML_KERNELS=0 turns them off, =all gives them every type (to compare, or to test
either path). Which types they hold where: `holds`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch

from engine.disk import build_lock
from engine.disk.cache_folder import default_cache_dir
from engine.gguf.blocks import Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q6_K, Q8_0

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "ggml_dot.cpp"  # includes its headers there
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-std=c++20", "-shared", "-fPIC")
# The kernels' AVX-512 VNNI form (ggml_dot.cpp's VNNI): under torch's AVX-512 kernel set, on a
# CPU that has these; the integer sums are the same, fewer instructions make them
VNNI_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
VNNI_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"})
# A CPU with these multiplies bf16 natively (else torch widens it to float32 first)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
KERNEL_SETS = ("avx2", "vnni")  # a library's name says which it was built for
# the ggml types the kernels read (multiply, and dequantise rows of as gguf does: ggml_rows)
TYPES = (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K)

_state: dict[str, str | None] = {}  # "reason": why the kernels did not load, once tried


def kernel_set() -> str:
    """The form the kernels take here: "vnni" under torch's AVX-512 kernel set on a CPU with
    AVX-512 VNNI, else "avx2" (so ATEN_CPU_CAPABILITY=avx2 runs them as an AVX2-only machine
    would, too)."""
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    return "vnni" if avx512 and cpu_flags() >= VNNI_CPU_FLAGS else "avx2"


@functools.cache
def dense_dtype() -> torch.dtype:
    """The dtype of a prefill's dequantised panels (ggml_dense_mm): bf16 on a CPU with bf16 dot
    products (AVX-512 BF16, AMX), float32 elsewhere, where torch multiplies bf16 by widening
    it, at a third of float32's rate or less."""
    return torch.bfloat16 if cpu_flags() & BF16_CPU_FLAGS else torch.float32


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The instruction sets /proc/cpuinfo lists for this CPU (none where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def flags(kernels: str) -> tuple[str, ...]:
    """The compiler's flags for a kernel set."""
    return FLAGS + VNNI_FLAGS if kernels == "vnni" else FLAGS


def library_path(folder: Path, kernels: str = "avx2") -> Path:
    """Where the built library is kept: named by its kernel set, its sources (the .cpp and
    the headers it includes: a change to any of them builds anew), torch and the flags."""
    digest = hashlib.sha256(" ".join(flags(kernels)).encode())
    for source in sorted(SOURCE.parent.glob("*.[ch]*")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    key = digest.hexdigest()[:12]
    version = torch.__version__.replace("+", "-")
    return folder / "kernels" / f"ggml_dot-{kernels}-torch{version}-{key}.so"


# The types the kernels hold under torch's AVX-512 kernels: where they beat its int4 kernel on
# one row of Qwen2.5-1.5B's and Gemma-3-270M's weights (Q5_0 also holds Gemma's ffn_gate in
# 0.69 bytes a value against 1.25); not the 32-value 4-bit types (Q4_1 is no faster), nor Q5_1
# (unmeasured). Under AVX2 they beat it at every type they read.
AVX512_TYPES = (Q5_0, Q8_0, Q4_K, Q6_K)


def in_use() -> bool:
    """Whether any weight goes to the GGML kernels: loaded (built first where needed, once a
    process) and not turned off by $GLASSBOX_GGML_KERNELS=0 (read at each call)."""
    return os.environ.get("GLASSBOX_GGML_KERNELS") != "0" and ensure() is None


def holds(qtype: int) -> bool:
    """Whether weights of `qtype` go to the GGML kernels: every type they read under torch's
    AVX2 kernels, AVX512_TYPES under AVX-512 (where they are faster, see above);
    $GLASSBOX_GGML_KERNELS=all gives them every type anywhere."""
    if qtype not in TYPES or not in_use():
        return False
    every = os.environ.get("GLASSBOX_GGML_KERNELS") == "all"
    return every or qtype in AVX512_TYPES or torch.backends.cpu.get_cpu_capability() == "AVX2"


def ensure() -> str | None:
    """Load the kernels, building them first where the cache folder has none (~10 s, once
    per machine and torch). Returns why they cannot be used, or None. Tried once a process."""
    if "reason" not in _state:
        kernels = kernel_set()
        reason = _refusal() or _load(library_path(default_cache_dir(), kernels))
        if reason is not None and kernels == "vnni" and reason.startswith("the kernels did not"):
            # a compiler without AVX-512 VNNI still builds the AVX2 form
            log.info("the GGML kernels' VNNI form failed (%s); building the AVX2 form", reason)
            kernels, reason = "avx2", _load(library_path(default_cache_dir(), "avx2"))
        _state["reason"] = reason
        if reason is not None:
            log.info("the GGML kernels are off, torch's int4 kernel runs: %s", reason)
        else:
            log.info("the GGML kernels run in their %s form", kernels)
    return _state["reason"]


def _refusal() -> str | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"torch's CPU kernel set is {capability}, not AVX2 or AVX-512"
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()}) on the PATH"
    return None


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _load(path: Path) -> str | None:
    try:
        with build_lock.building(path) as missing:
            if missing:
                _build(path)
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    except (OSError, RuntimeError, subprocess.CalledProcessError) as error:
        return f"the kernels did not build or load: {_last_line(error)}"
    _register_fakes()
    return None


def _build(path: Path) -> None:
    from torch.utils import cpp_extension

    partial = build_lock.partial_folder(path)
    partial.mkdir(parents=True, exist_ok=True)
    try:
        built = partial / path.name
        abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        includes.append(f"-I{sysconfig.get_paths()['include']}")
        libraries = [f"-L{p}" for p in cpp_extension.library_paths()]
        rpath = [f"-Wl,-rpath,{p}" for p in cpp_extension.library_paths()]
        command = [_compiler(), *flags(_kernels_of(path)), abi, *includes, str(SOURCE)]
        command += ["-o", str(built)]
        command += [*libraries, *rpath, "-lc10", "-ltorch_cpu"]
        log.info("building the GGML kernels (once, ~10 s)")
        subprocess.run(command, check=True, capture_output=True, text=True)
        built.replace(path)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    _remove_older(path)


def _kernels_of(path: Path) -> str:
    """The kernel set a library's name says it was built for (library_path)."""
    return path.name.split("-")[1]


def _remove_older(path: Path) -> None:
    """Delete the libraries of other sources or torch versions beside `path`, and their locks:
    no run loads them again (a process that has one loaded keeps its mapping). The other
    kernel set's library stays: a run under ATEN_CPU_CAPABILITY=avx2 loads it."""
    kernels = _kernels_of(path)
    for other in path.parent.glob("ggml_dot-*.so*"):
        ours = other.name in (path.name, build_lock.lock_path(path).name)
        other_set = _kernels_of(other) in KERNEL_SETS and _kernels_of(other) != kernels
        if not ours and not other_set:
            other.unlink(missing_ok=True)


def _last_line(error: BaseException) -> str:
    text = getattr(error, "stderr", None) or str(error)
    lines = [line for line in str(text).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


@functools.cache
def _register_fakes() -> None:
    """Shapes for torch.export (the compiled decode step), without running the kernels."""

    @torch.library.register_fake("glassbox::ggml_mm")  # type: ignore[untyped-decorator]
    def _mm(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], raw.shape[0])

    @torch.library.register_fake("glassbox::ggml_dense_mm")  # type: ignore[untyped-decorator]
    def _dense_mm(x: torch.Tensor, raw: torch.Tensor, qtype: int) -> torch.Tensor:
        return x.new_empty(x.shape[0], raw.shape[0])

    @torch.library.register_fake("glassbox::attend_one")  # type: ignore[untyped-decorator]
    def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return q.new_empty(q.shape, dtype=torch.float32)

    @torch.library.register_fake("glassbox::top_k_rows")  # type: ignore[untyped-decorator]
    def _top_k_rows(values: torch.Tensor, k: int) -> torch.Tensor:
        return values.new_empty(values.shape[0], k, dtype=torch.int64)

    @torch.library.register_fake("glassbox::top_k_softmax")  # type: ignore[untyped-decorator]
    def _top_k_softmax(rows: list[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        first = rows[0]
        return first.new_empty(len(rows), k, dtype=torch.int64), first.new_empty(len(rows), k)

    @torch.library.register_fake("glassbox::head_statistics")  # type: ignore[untyped-decorator]
    def _head_statistics(rows: list[torch.Tensor]) -> torch.Tensor:
        return rows[0].new_empty(len(rows), 2, rows[0].shape[0], dtype=torch.float32)

    @torch.library.register_fake("glassbox::causal_rows")  # type: ignore[untyped-decorator]
    def _causal_rows(
        query: torch.Tensor, key: torch.Tensor, scaling: float, rows: int
    ) -> torch.Tensor:
        return query.new_empty(query.shape[1], rows, key.shape[2], dtype=torch.float32)

    @torch.library.register_fake("glassbox::first_largest")  # type: ignore[untyped-decorator]
    def _first_largest(values: torch.Tensor) -> torch.Tensor:
        return values.new_empty((), dtype=torch.int64)

    @torch.library.register_fake("glassbox::exact_head")  # type: ignore[untyped-decorator]
    def _exact_head(
        bulk: torch.Tensor, raw: torch.Tensor, qtype: int, x: torch.Tensor, k: int
    ) -> torch.Tensor:
        return bulk.new_empty(bulk.shape, dtype=torch.float32)

    @torch.library.register_fake("glassbox::ggml_rows")  # type: ignore[untyped-decorator]
    def _rows(raw: torch.Tensor, index: torch.Tensor, qtype: int, columns: int) -> torch.Tensor:
        return raw.new_empty(index.shape[0], columns, dtype=torch.float32)

    @torch.library.register_fake("glassbox::norm_rows")  # type: ignore[untyped-decorator]
    def _norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x.new_empty(x.shape, dtype=torch.bfloat16)

    @torch.library.register_fake("glassbox::ggml_dequantize")  # type: ignore[untyped-decorator]
    def _dequantize(raw: torch.Tensor, qtype: int, columns: int) -> torch.Tensor:
        return raw.new_empty(raw.shape[0], columns, dtype=torch.bfloat16)
