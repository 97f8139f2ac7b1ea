"""A GGUF's tokenizer, converted once and kept in the cache folder (tokenizer.json and its chat
template, a few MB), keyed by the file, so later starts load it in its fast form at once."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from engine.load.loaded import ModelLoadError, Progress, short, with_pad
from engine.model.gguf_shape import release_freed_memory
from engine.text.tokenizer import LeanTokenizer, compact_merges

if TYPE_CHECKING:  # transformers is imported only on the paths that need it
    from transformers import PreTrainedTokenizerBase


def gguf_tokenizer(
    path: Path, cache_dir: Path, report: Progress, lean: bool = False
) -> PreTrainedTokenizerBase:
    """The GGUF's tokenizer in its fast form, converted once and kept in the cache folder:
    transformers' tokenizer, or with `lean` the same tokenizer.json without transformers."""
    # "-2": merges kept as strings (lean_tokenizer.compact_merges); an older folder is redone
    # and removed.
    folder = cache_dir / "tokenizers" / f"{path.stem}-{file_key(path)}-2"
    if not (folder / "tokenizer.json").is_file():
        report("Loading the tokenizer converter (first start only)", 0.03)
        try:
            convert = _tokenizer_converter()
            report("Converting the tokenizer (first start only)", 0.1)
            tokenizer = convert(path)
        except Exception as error:
            raise ModelLoadError(f"{path} is not a readable GGUF model: {short(error)}") from None

        def save(staging: Path) -> None:
            tokenizer.save_pretrained(staging)
            compact_merges(staging / "tokenizer.json")

        save_atomically(folder, save)
        shutil.rmtree(folder.with_name(folder.name.removesuffix("-2")), ignore_errors=True)
    report("Loading the tokenizer", 0.2)
    if lean:  # it stands in for transformers' tokenizer: the few methods the engine calls
        lean_tokenizer = LeanTokenizer.from_folder(folder)
        # Parsing tokenizer.json frees part of what it allocates (Gemma 3's: tens of MB), which
        # glibc would keep under the weights loaded next.
        release_freed_memory()
        return cast("PreTrainedTokenizerBase", with_pad(lean_tokenizer))
    from transformers import PreTrainedTokenizerFast

    fast: PreTrainedTokenizerBase = PreTrainedTokenizerFast.from_pretrained(str(folder))
    return with_pad(fast)


def _tokenizer_converter() -> Callable[[Path], PreTrainedTokenizerBase]:
    """transformers' GGUF tokenizer conversion (it imports transformers: seconds).

    Where transformers exposes its GGUF tokenizer builders, they are called directly: the
    same tokenizer.json and chat template as AutoTokenizer's, in a fraction of its time,
    because AutoTokenizer also parses the whole file's metadata into a config it then drops.
    """
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )
    except ImportError:  # another transformers: its public path
        from transformers import AutoTokenizer

        return lambda path: AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)

    def convert(path: Path) -> PreTrainedTokenizerBase:
        architecture, vocabulary, config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, vocabulary)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)  # type: ignore[no-untyped-call, unused-ignore]

    return convert


def file_key(path: Path) -> str:
    """Names what is derived from a file in the cache: its path, size and modification time."""
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def save_atomically(folder: Path, save: Callable[[Path], object]) -> None:
    """Write into a staging folder, then rename it into place: never a half-written folder."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    try:
        save(staging)
        staging.rename(folder)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not folder.is_dir():  # not another process that got there first
            raise
