#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=30
# Tier L0 (every change): the known-bug regression tests of the functional suites (not slow).
# Generation cpu: CPU backend (gloo), no GPU needed; xdist workers: 1.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init cpu 1
harness_run_pytest tests/functional -m regression
