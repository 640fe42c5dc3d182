#!/usr/bin/env bash
# GPU_COUNT=2
# CI_TIMEOUT=20
# Tier L0 (every change): the mesh shapes (HSDP, HFSDP, CP, TP-plain, plain) on 2 ranks, not slow.
# Generation h200: 2 GPUs, one NCCL rank each (the 4-rank mesh suites need 4); xdist workers: 1
# (the selection is one 2-rank bucket, which a second worker could not share).
set -euo pipefail
# shellcheck source=../../common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
harness_init h200 1
harness_run_pytest tests/functional/test_mesh_world2.py
