#!/usr/bin/env bash
# GPU_COUNT=2
# CI_TIMEOUT=20
# Tier L0 (every change): CUDA-graph replay on 2 ranks (plain FSDP, HSDP, HFSDP, unshard pool, SGD), not slow.
# Generation h200: 2 GPUs, one NCCL rank each; xdist workers: 1 (the selection is one 2-rank bucket,
# which a second worker could not share).
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init h200 1
harness_run_pytest tests/functional/test_cuda_graph.py -k world2
