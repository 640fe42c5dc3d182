#!/usr/bin/env bash
# GPU_COUNT=2
# CI_TIMEOUT=30
# Tier L0 (every change): the FP8 slice on 2 ranks: torch-native FP8 parameters (test_fp8.py),
# TransformerEngine FP8 parameters, the seed's TE FP8 cases at world 2 and the decoupled-grad
# regressions with TE FusedAdam. TE cases skip (naming the missing module) without TransformerEngine.
# Generation h200: 2 GPUs, one NCCL rank each; xdist workers: 1 (the 2-rank buckets need both GPUs).
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init h200 1
harness_run_pytest tests/functional/test_fp8.py tests/functional/test_fp8_te.py \
    tests/functional/test_fp8_te_seed.py tests/functional/test_decoupled_grad_te.py \
    -k "not te_transformer"
