#!/usr/bin/env bash
# GPU_COUNT=0
# CI_TIMEOUT=30
# Tier L0 (every change): a few cells of every functional suite (the l0 mark, tests/functional/conftest.py)
# the known-bug regression tests and the golden cells (tests/golden/<gen>/), none marked slow.
# Generation cpu: CPU backend (gloo), no GPU needed; xdist workers: 1.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init cpu 1
harness_run_pytest tests/functional -m "l0 or regression or golden"
