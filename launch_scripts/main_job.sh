#!/usr/bin/env bash
# The main job (README quick start, step 1) on a fresh machine: create or reuse .venv,
# install torch and the project with its test extras, run the L0 tier on this machine's
# default backend (the cpu generation when there is no NVIDIA GPU) and say where the
# JUnit XML and the sign-off report are. Exit status: that of run_tier.sh.
#
# Environment: PYTHON (interpreter for the venv, default python3), VENV (default .venv),
# HARNESS_TORCH_VERSION (default 2.13.0), HARNESS_OUT_DIR (default results).
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$HARNESS_REPO_ROOT"

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
TORCH_VERSION=${HARNESS_TORCH_VERSION:-2.13.0}
detected=$(harness_detect_gpus)
gen=${detected% *}

if [ ! -x "$VENV/bin/python" ]; then
    if [ "$gen" = cpu ]; then
        harness_log "creating virtual environment $VENV"
        "$PYTHON" -m venv "$VENV"
    else
        # GPU images ship a CUDA build of torch system-wide: let the venv see it.
        harness_log "creating virtual environment $VENV (with system site-packages)"
        "$PYTHON" -m venv --system-site-packages "$VENV"
    fi
fi
# shellcheck disable=SC1091  # the venv's activate script exists only at run time
source "$VENV/bin/activate"
case "$VENV" in
    /*) PYTHON="$VENV/bin/python" ;;
    *) PYTHON="$HARNESS_REPO_ROOT/$VENV/bin/python" ;;
esac
export PYTHON # the launch scripts run pytest with the venv's python

if [ "$gen" = cpu ]; then
    harness_log "no NVIDIA GPU: installing torch==$TORCH_VERSION (CPU build)"
    python -m pip install -q "torch==$TORCH_VERSION"
elif python -c 'import torch' 2>/dev/null; then
    harness_log "reusing installed torch $(python -c 'import torch; print(torch.__version__)')"
else
    harness_log "no importable torch: installing torch==$TORCH_VERSION"
    python -m pip install -q "torch==$TORCH_VERSION"
fi
harness_log "installing fsdp-harness with test extras"
python -m pip install -q -e '.[test]'

case " $HARNESS_GENERATIONS " in
    *" $gen "*) ;;
    *)
        harness_log "WARNING: GPUs not supported by the launch scripts ($detected); using the cpu generation"
        gen=cpu
        ;;
esac

rc=0
bash launch_scripts/run_tier.sh L0 --gen "$gen" || rc=$?
out_root=${HARNESS_OUT_DIR:-results}
echo
echo "JUnit XML:        $out_root/$gen/L0_*.xml"
echo "Sign-off report:  $out_root/signoff/report.md, report.html (matrix heat map), summary.json"
exit "$rc"
