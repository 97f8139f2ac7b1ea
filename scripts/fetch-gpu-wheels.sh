#!/usr/bin/env bash
# Run where there is network, before a GPU check: the wheels a GPU machine without network or
# package registry lacks (a CUDA PyTorch image has torch, transformers, tokenizers, jinja2,
# numpy, filelock), and the bundled model's tokenizer for the tests' `tokenizer` fixture, into
# .whl/ (ignored by git; it travels with the working tree, 64 MiB at most in all).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
DEST=.whl
LIMIT_MIB=32  # well under what travels, leaving room for the repository itself
mkdir -p "$DEST"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" \
    gguf platformdirs psutil accelerate markdown pytest pluggy iniconfig pygments pytest-timeout
# pytest's own on Python < 3.11, pure Python: whatever Python the GPU machine has
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$DEST" --python-version 3.10 \
    --implementation py --abi none --platform any tomli exceptiongroup
"$PY" - "$DEST/tokenizer" <<'PYTHON'
import sys
from engine.disk.cache_folder import default_cache_dir
from engine.load.loader import bundled_gguf_path, gguf_tokenizer

tokenizer = gguf_tokenizer(bundled_gguf_path(), default_cache_dir(), lambda stage, done: None)
tokenizer.save_pretrained(sys.argv[1])
PYTHON
size=$(du -sb "$DEST" | cut -f1)
echo "$DEST: $(ls "$DEST" | wc -l) entries, $((size / 1024)) KiB"
if [ "$size" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "$DEST holds more than $LIMIT_MIB MiB: remove what the GPU machine does not need" >&2
    exit 1
fi
