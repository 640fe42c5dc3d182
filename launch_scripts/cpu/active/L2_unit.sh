#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=60
# Tier L2 (full matrix): the unit suites, tests marked slow included (L0_unit deselects them).
# Generation cpu: CPU backend (gloo), no GPU needed; xdist workers: 2.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init cpu 2
harness_run_pytest tests/unit
