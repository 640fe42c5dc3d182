#!/usr/bin/env bash
# GPU_COUNT=8
# CI_TIMEOUT=60
# Tier L2 (full matrix): the unit suites, tests marked slow included (L0_unit deselects them).
# Generation h200: 8 GPUs; xdist workers: 4.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init h200 4
harness_run_pytest tests/unit
