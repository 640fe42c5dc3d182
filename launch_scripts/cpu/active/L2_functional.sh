#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=300
# Tier L2 (full matrix): every functional test, every parametrisation.
# Generation cpu: CPU backend (gloo), no GPU needed; xdist workers: 1.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init cpu 1
export HARNESS_FULL_MATRIX=1  # suites widen their parametrisation when set
harness_run_pytest tests/functional
