#!/usr/bin/env bash
# GPU_COUNT=8
# CI_TIMEOUT=30
# Tier L0 (every change): a few cells of every functional suite (the l0 mark, tests/functional/conftest.py)
# the known-bug regression tests and the golden cells (tests/golden/<gen>/), none marked slow.
# Generation b200: 8 GPUs; xdist workers: 4.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init b200 4
harness_run_pytest tests/functional -m "l0 or regression or golden"
