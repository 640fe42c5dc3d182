#!/usr/bin/env bash
# Runs the benchmark suite (python -m bench.suite) on every visible GPU: all implementations (ours
# ZeRO-3/ZeRO-2/HSDP, Megatron-FSDP when installed, FSDP2 with and without reshard, DDP, the one-GPU
# ceiling) at the 1.3B size, 3 alternating repetitions, each cell a fresh torchrun over all GPUs, and
# prints the table with ratios vs FSDP2 and the ceiling. Extra arguments go to the suite (e.g. --sizes
# 0.35b,1.3b --reps 5, or --impls ours-z3,fsdp2).
# Results: ${BENCH_OUT:-bench_results.jsonl} (JSON lines) and the same path with .md (the table).
# Everything (all sizes, the step profile, the CUDA-graph bench): bench/gpu_all.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
py=${PYTHON:-python3}
out=${BENCH_OUT:-bench_results.jsonl}
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
[ "$ngpu" -ge 1 ] || { echo "bench needs at least one CUDA GPU" >&2; exit 2; }
"$py" -m bench.suite --nproc-per-node "$ngpu" --sizes 1.3b --out "$out" --md "${out%.jsonl}.md" "$@"
