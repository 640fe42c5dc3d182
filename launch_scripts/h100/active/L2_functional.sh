#!/usr/bin/env bash
# GPU_COUNT=8
# CI_TIMEOUT=300
# Tier L2 (full matrix): every functional test, every parametrisation.
# Generation h100: 8 GPUs; xdist workers: 4.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init h100 4
export HARNESS_FULL_MATRIX=1  # suites widen their parametrisation when set
harness_run_pytest tests/functional
