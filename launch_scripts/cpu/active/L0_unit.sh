#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=20
# Tier L0 (every change): the unit suites (pieces, policies, the harness's own behaviour), not slow.
# Generation cpu: CPU backend (gloo), no GPU needed; xdist workers: 2.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init cpu 2
harness_run_pytest tests/unit
