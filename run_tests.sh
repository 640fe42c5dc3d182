#!/usr/bin/env bash
# The project's test command (README quick start, step 2; .ci/run calls exactly this).
# Creates or reuses .venv, installs torch (CPU build when no NVIDIA GPU is present) and the project with its
# test extras, then runs the unit and functional suites and writes JUnit XML under results/.
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

if ! python -c 'import torch' 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        echo "[run_tests] NVIDIA GPU found: install a CUDA build of torch into $VENV first" >&2
        exit 2
    fi
    echo "[run_tests] installing torch 2.13.0 (CPU build)"
    python -m pip install -q torch==2.13.0
fi
echo "[run_tests] installing fsdp-harness with test extras"
python -m pip install -q -e '.[test]'

# pytest-forked 1.7.5 breaks on pytest >= 9.2; the pin lives in pyproject.toml and is checked here.
python - <<'PY'
import pytest
major, minor = (int(x) for x in pytest.__version__.split(".")[:2])
assert (major, minor) < (9, 2), f"pytest {pytest.__version__} breaks pytest-forked 1.7.5; the pin is <9.2"
print(f"[run_tests] pytest {pytest.__version__} (pinned <9.2 for pytest-forked)")
PY

mkdir -p "$OUT"
set +e
python -m pytest tests -q -rfEs --junitxml="$OUT/tests.xml" "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "[run_tests] no tests were collected" >&2
fi
exit "$rc"
