#!/usr/bin/env bash
# The project's test command (README quick start, step 2; .ci/run calls exactly this).
# Creates or reuses .venv (VENV=...), installs torch (CPU build 2.13.0 when no NVIDIA GPU is present;
# TORCH_VERSION=X.Y.Z installs that release instead) and the project with its test, lint and hf extras, then
# runs ruff and mypy, the CPU L0 tier (unit suites, the l0 cells of every functional suite and the
# known-bug regression tests, with a sign-off report), the golden cells again with OMP_NUM_THREADS=1,
# and every test L0 leaves out (slow ones, the rest of the functional suites), writing JUnit XML under
# results/. With arguments, it runs plain pytest with them instead (e.g. bash run_tests.sh tests/unit/fsdp -x).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
OUT=${HARNESS_OUT_DIR:-results}

if [ ! -x "$VENV/bin/python" ]; then
    echo "[run_tests] creating virtual environment $VENV"
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

if [ -n "${TORCH_VERSION:-}" ]; then
    # Another supported torch on purpose (e.g. TORCH_VERSION=2.14.1 VENV=.venv-2.14: the package index has
    # 2.14.1 only as the CUDA build, several GB, which also runs on a CPU-only machine).
    have=$(python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo none)
    if [ "$have" != "$TORCH_VERSION" ]; then
        echo "[run_tests] installing torch $TORCH_VERSION into $VENV (found: $have)"
        python -m pip install -q "torch==$TORCH_VERSION"
    fi
elif ! python -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[run_tests] NVIDIA GPU found: install a CUDA build of torch into $VENV first" >&2
        exit 2
    fi
    echo "[run_tests] installing torch 2.13.0 (CPU build)"
    python -m pip install -q torch==2.13.0
fi
echo "[run_tests] installing fsdp-harness with test, lint and hf extras"
python -m pip install -q -e '.[test,lint,hf]'

# pytest-forked 1.7.5 breaks on pytest >= 9.2; the pin lives in pyproject.toml and is checked here.
python - <<'PY'
import pytest
major, minor = (int(x) for x in pytest.__version__.split(".")[:2])
assert (major, minor) < (9, 2), f"pytest {pytest.__version__} breaks pytest-forked 1.7.5; the pin is <9.2"
print(f"[run_tests] pytest {pytest.__version__} (pinned <9.2 for pytest-forked)")
PY

mkdir -p "$OUT"
if [ "$#" -gt 0 ]; then
    # Developer mode: plain pytest with the given arguments.
    exec python -m pytest -rfEs "$@"
fi

# The whole suite, split so that the CPU L0 tier (tests/unit, the l0 cells and the known-bug
# regression tests, without tests marked slow, with its sign-off in $OUT/signoff/) runs exactly as
# launch_scripts/cpu runs it, followed by everything L0 leaves out: the slow unit tests and
# the functional tests that are not "(l0 or regression or golden) and not slow".
rc=0
# Lint and types first (seconds); a finding fails the run, but the tests still run and report.
echo "[run_tests] ruff check . && mypy"
ruff check . || rc=$?
mypy || rc=$?
HARNESS_OUT_DIR="$OUT" bash launch_scripts/run_tier.sh L0 --gen cpu || rc=$?
echo "[run_tests] lint + L0 tier (cpu) exit status $rc; sign-off report: $OUT/signoff/report.md (and .html)"

# rest NAME PATH EXPR: pytest on PATH -m EXPR into $OUT/NAME.xml; nothing selected is fine.
rest() {
    local status=0
    python -m pytest "$2" -m "$3" -q -rfEs --junitxml="$OUT/$1.xml" || status=$?
    if [ "$status" -eq 5 ]; then
        echo "[run_tests] $2: no tests outside the L0 tier were collected" >&2
        status=0
    fi
    [ "$rc" -eq 0 ] && rc=$status
    return 0
}
# The golden cells once more with OMP_NUM_THREADS=1 exported: pinned numerics make their bits independent
# of the machine's thread count (the L0 tier above ran them with the default one).
echo "[run_tests] golden cells again with OMP_NUM_THREADS=1"
OMP_NUM_THREADS=1 python -m pytest tests/functional/test_golden.py tests/functional/test_checkpoint_compat.py \
    -m "golden and not slow" -q -rfEs --junitxml="$OUT/golden-omp1.xml" || { [ "$rc" -eq 0 ] && rc=1; }
rest unit-slow tests/unit "slow"
rest functional tests/functional "not (l0 or regression or golden) or slow"
exit "$rc"
