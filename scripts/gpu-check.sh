#!/usr/bin/env bash
# The GPU check, on a machine with an NVIDIA GPU and torch preinstalled, without network: it
# installs what the image lacks from the wheels scripts/fetch-gpu-wheels.sh put in .whl/, runs
# the tests that need CUDA, then `glassbox bench --device cuda` on the three model shapes, and
# writes one report, OUT/gpu-check.json (with the bench's JSON and pytest's summary beside it).
#
#   scripts/gpu-check.sh OUT [--dry-run] [--device cpu]
#
# Each part has a time limit (below, in seconds; their sum, 480, is 8 minutes); a part that
# fails or runs out of time is recorded as such and the others still run. --dry-run records
# the commands without running them (nor installing anything).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: scripts/gpu-check.sh OUT [--dry-run] [--device cpu]}
shift
DRY=0
DEVICE=cuda
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --device) DEVICE=$2; shift ;;
        *) echo "gpu-check: unknown option $1" >&2; exit 2 ;;
    esac
    shift
done
PY=${PYTHON:-python3}
TESTS_S=${TESTS_S:-100}
BUNDLED_S=${BUNDLED_S:-170}  # each shape's bench: write the shape (first run), load, compile, run
QWEN_S=${QWEN_S:-110}
GEMMA_S=${GEMMA_S:-70}
CHECK_S=480  # the whole check's bound: what the steps above leave goes to the int4 comparison
INT4_MIN_S=60  # the least worth starting it with
STARTED=$(date +%s)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
# Shapes are written here (Qwen's is 1.1 GB): never under OUT, which travels back.
export GLASSBOX_CACHE_DIR=${GLASSBOX_CACHE_DIR:-${TMPDIR:-/tmp}/glassbox-gpu-check}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
[ -d .whl/tokenizer ] && export GLASSBOX_TEST_TOKENIZER=$PWD/.whl/tokenizer
STEPS="$OUT/steps.tsv"  # name, exit status, seconds, time limit, command
: > "$STEPS"

step() {  # step NAME LIMIT_S COMMAND...: run it (or, dry, only record it) with its output kept
    local name=$1 limit=$2 start status
    shift 2
    start=$(date +%s)
    if [ "$DRY" = 1 ]; then
        status=0
    else
        timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
        status=$?
    fi
    printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$(($(date +%s) - start))" "$limit" "$*" \
        >> "$STEPS"
    echo "gpu-check: $name: exit $status"
}

# 1. What the image lacks (module:distribution), installed from the carried wheels only
missing=()
unavailable=()
for pair in gguf:gguf platformdirs:platformdirs psutil:psutil accelerate:accelerate \
    markdown:markdown pytest:pytest pluggy:pluggy iniconfig:iniconfig pygments:pygments \
    pytest_timeout:pytest-timeout tokenizers:tokenizers \
    jinja2:jinja2 filelock:filelock numpy:numpy transformers:transformers; do
    "$PY" -c "import ${pair%%:*}" 2> /dev/null && continue
    dist=${pair#*:}
    if compgen -G ".whl/${dist//-/_}-*.whl" > /dev/null; then
        missing+=("$dist")
    else
        unavailable+=("$dist")
    fi
done
echo "${missing[*]:-}" > "$OUT/installed.txt"
echo "${unavailable[*]:-}" > "$OUT/unavailable.txt"
# Into a folder of their own, each wheel without its dependencies (those that matter here come
# with transformers): the image's own environment may not be writable
SITE="$GLASSBOX_CACHE_DIR/site-packages"
if [ ${#missing[@]} -gt 0 ]; then
    wheels=()
    for dist in "${missing[@]}"; do wheels+=(.whl/"${dist//-/_}"-*.whl); done
    step install 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target "$SITE" "${wheels[@]}"
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

# 2. The tests that run on CUDA (their CPU twins run in CI); the bundled model's are left out
step pytest "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider -m "not bundled and not real_models" \
    -k cuda tests/engine/step/test_static.py tests/engine/generate/test_run_ahead.py \
    tests/engine/measure/test_accelerator.py \
    tests/engine/gguf/test_torch_blocks.py tests/engine/model/test_device_form.py \
    tests/engine/step/test_lens_steps.py
[ "$DRY" = 1 ] || tail -n 15 "$OUT/pytest.log" > "$OUT/pytest-summary.txt"

# 3. The bench on each shape: the bundled one against generate, the larger ones engine alone
bench() {  # bench SHAPE LIMIT_S OPTIONS...
    local shape=$1 limit=$2
    shift 2
    step "bench-$shape" "$limit" "$PY" -m app bench --device "$DEVICE" --model "shape:$shape" \
        --json --output "$OUT/bench-$shape.json" "$@"
}
bench bundled "$BUNDLED_S" --new-tokens 128 --repeats 3
bench qwen2.5-1.5b "$QWEN_S" --new-tokens 128 --repeats 3 --fast-only
bench gemma-3-270m "$GEMMA_S" --new-tokens 64 --repeats 2 --fast-only

# 4. With the time the steps above left (they rarely use their whole limits): the bundled
# shape in CUDA's int4 form beside its bf16 one, in one run
left=$((CHECK_S - 30 - ($(date +%s) - STARTED)))
if [ "$left" -ge "$INT4_MIN_S" ]; then
    step bench-bundled-int4 "$left" "$PY" -m app bench --device "$DEVICE" --model shape:bundled \
        --fast-only --int4 --new-tokens 128 --repeats 2 --json \
        --output "$OUT/bench-bundled-int4.json"
else
    echo "gpu-check: bench-bundled-int4: skipped, $left s left"
fi

# 5. One report
"$PY" - "$OUT" "$DRY" <<'PYTHON'
import json, sys
from pathlib import Path

out, dry = Path(sys.argv[1]), sys.argv[2] == "1"
report = {
    "dry_run": dry,
    "installed": (out / "installed.txt").read_text().split(),
    "unavailable": (out / "unavailable.txt").read_text().split(),  # missing, and no wheel
    "steps": [],
}
for line in (out / "steps.tsv").read_text().splitlines():
    name, status, seconds, limit, command = line.split("\t", 4)
    step = {"name": name, "exit": int(status), "seconds": int(seconds), "limit_s": int(limit)}
    step["command"] = command
    bench = out / f"{name}.json"
    if bench.is_file():
        step["result"] = json.loads(bench.read_text())
    report["steps"].append(step)
summary = out / "pytest-summary.txt"
report["pytest_summary"] = summary.read_text() if summary.is_file() else None
try:
    import torch
    report["torch"] = torch.__version__
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    import transformers
    report["transformers"] = transformers.__version__
except ImportError as error:
    report["import_error"] = str(error)
(out / "gpu-check.json").write_text(json.dumps(report, indent=2))
failed = [step["name"] for step in report["steps"] if step["exit"] != 0]
print(f"gpu-check: report in {out / 'gpu-check.json'}; failed: {', '.join(failed) or 'none'}")
sys.exit(1 if failed else 0)
PYTHON
