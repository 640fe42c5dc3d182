#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=120
# Tier L1 (daily): the functional suites without tests marked slow.
# Generation cpu: CPU backend (gloo), no GPU needed; xdist workers: 1.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init cpu 1
harness_run_pytest tests/functional -m "not slow"
