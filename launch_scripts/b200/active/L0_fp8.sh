#!/usr/bin/env bash
# GPU_COUNT=8
# CI_TIMEOUT=30
# Tier L0 (every change): the FP8 suites, where MXFP8 parameters run (sm_100):
# torch-native and TransformerEngine FP8 parameters, the seed's TE FP8 cases, FusedAdam regressions.
# Generation b200: 8 GPUs; xdist workers: 4.
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init b200 4
harness_run_pytest tests/functional/test_fp8.py tests/functional/test_fp8_te.py \
    tests/functional/test_fp8_te_seed.py tests/functional/test_decoupled_grad_te.py
