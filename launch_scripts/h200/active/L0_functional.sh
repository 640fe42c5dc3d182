#!/usr/bin/env bash
# GPU_COUNT=2
# CI_TIMEOUT=30
# Tier L0 (every change): a few cells of every functional suite (the l0 mark, tests/functional/conftest.py)
# the known-bug regression tests and the golden cells (tests/golden/<gen>/), none marked slow.
# Generation h200: 2 GPUs (the device tool lends 1 or 2 H200s; more GPUs are fine); xdist workers: 2.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init h200 2
harness_run_pytest tests/functional -m "l0 or regression or golden"
