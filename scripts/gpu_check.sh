#!/usr/bin/env bash
# make gpu-check OUT=DIR: every CUDA path of the engine proved and measured on one GPU, in one report.
#
# Runs with the machine's own Python and torch (GPU_PYTHON, default python3): nothing replaces its
# torch. What the check lacks is installed from the wheels in GPU_WHEELS (default .whl/, filled by
# `make gpu-wheels` on a machine with network), without dependencies and without an index, into
# .gpu-site/; the package runs from src/. Each part has its own time limit, all of them together GPU_BUDGET seconds
# (default 540: the check fits in 9 minutes); a part that fails or runs out of time does not stop the
# others, and the report (DIR/gpu-report.md and .json) is written whatever happened.
set -u
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
WHEELS=${GPU_WHEELS:-.whl}
BUDGET=${GPU_BUDGET:-540}
OUT=${1:-}

# Bad input first, before anything is created: one line, exit 2.
if [ -z "$OUT" ]; then
    echo "gpu-check: no report directory given: make gpu-check OUT=DIR (or scripts/gpu_check.sh DIR)" >&2
    exit 2
fi
parent=$OUT
while [ ! -e "$parent" ]; do parent=$(dirname "$parent"); done
if [ ! -d "$parent" ] || [ ! -w "$parent" ]; then
    echo "gpu-check: cannot write the report under $OUT ($parent is not a writable directory): pick another OUT" >&2
    exit 2
fi
if ! command -v "$PY" > /dev/null; then
    echo "gpu-check: no $PY here: set GPU_PYTHON to the Python that has the CUDA build of torch" >&2
    exit 2
fi
# What is installed goes to .gpu-site/ (on PYTHONPATH), not into the machine's own site-packages.
SITE=$PWD/.gpu-site
export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -m ultrascale.testing.gpu_kit cuda || exit 2
"$PY" -m ultrascale.testing.gpu_kit install "$WHEELS" "$SITE" || exit 2

mkdir -p "$OUT/parts"
"$PY" -m ultrascale.testing.gpu_kit environment "$OUT"
START=$(date +%s)

# run_part NAME LIMIT COMMAND...: the command under `timeout`, its output in parts/NAME.log, its status
# (passed, failed, timeout) in parts/NAME.status.json. A benchmark writes its figures to parts/NAME.json.
run_part() {
    local name=$1 limit=$2; shift 2
    local left=$((BUDGET - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    local status="not run" rc=-1 t0 t1
    t0=$(date +%s.%N)
    if [ "$limit" -gt 5 ]; then
        echo "gpu-check: $name (at most ${limit}s)"
        timeout --kill-after=10 "$limit" "$@" > "$OUT/parts/$name.log" 2>&1
        rc=$?
        case $rc in 0) status=passed ;; 124|137) status=timeout ;; *) status=failed ;; esac
    fi
    t1=$(date +%s.%N)
    "$PY" - "$OUT/parts/$name.status.json" "$name" "$status" "$rc" "$t0" "$t1" "$limit" "$@" <<'PYEOF'
import json, sys
path, name, status, rc, t0, t1, limit, *cmd = sys.argv[1:]
part = {"name": name, "status": status, "rc": int(rc), "seconds": float(t1) - float(t0), "timeout_s": int(limit),
        "command": " ".join(cmd)}
if name == "tests":
    part["junit"] = "parts/tests.xml"
open(path, "w").write(json.dumps(part) + "\n")
PYEOF
    echo "gpu-check: $name $status"
}

P=$OUT/parts
# The tests share the one GPU over GPU_TEST_WORKERS processes (pytest-xdist, where that Python has it):
# they check numerics, not speed, and the card has room for several tiny runs at once.
WORKERS=()
if "$PY" -c "import xdist" 2> /dev/null; then WORKERS=(-n "${GPU_TEST_WORKERS:-4}"); fi
run_part tests 250 "$PY" -m pytest -v -p no:cacheprovider -o addopts="" -rA --strict-markers -m gpu \
    "${WORKERS[@]}" --timeout 200 --junitxml "$P/tests.xml" tests/test_gpu.py
run_part bench-gpu 180 "$PY" benchmarks/bench_gpu.py --json "$P/bench-gpu.json"
run_part bench-hf 90 "$PY" benchmarks/bench_single_vs_hf.py --device cuda --dtype bf16 --model 1b \
    --seq-len 2048 --micro-batch 2 --warmup 2 --repeats 3 --steps 2 --json "$P/bench-hf.json"
"$PY" -m ultrascale.testing.gpu_kit report "$OUT"
