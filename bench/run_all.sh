#!/usr/bin/env bash
# Runs the ZeRO-3 benchmark for fsdp_impl, PyTorch FSDP2 and the single-GPU ceiling in one go, on every
# visible GPU, and prints a table with the ratio ours/FSDP2. Extra arguments go to every run
# (e.g. --layers 4 for a quick check). Results: ${BENCH_OUT:-bench_results.jsonl}.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
out=${BENCH_OUT:-bench_results.jsonl}
: >"$out"
ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$ngpu" -ge 1 ] || { echo "bench needs at least one CUDA GPU" >&2; exit 2; }
python3 bench/fsdp_bench.py --impl ceiling --out "$out" "$@"
for impl in fsdp2 ours; do
    torchrun --standalone --nproc-per-node "$ngpu" bench/fsdp_bench.py --impl "$impl" --out "$out" "$@"
done
python3 - "$out" <<'PY'
import json, sys
rows = {r["impl"]: r for r in map(json.loads, open(sys.argv[1]))}
print(f"\n{'impl':8} {'world':>5} {'tok/s/GPU':>10} {'peak GiB':>9} {'step s':>8}")
for name in ("ceiling", "fsdp2", "ours"):
    r = rows.get(name)
    if r:
        print(f"{name:8} {r['world']:>5} {r['tok_s_per_gpu']:>10.0f} {r['peak_gib']:>9.2f} {r['step_s']:>8.3f}")
if "ours" in rows and "fsdp2" in rows:
    o, f = rows["ours"], rows["fsdp2"]
    print(f"ours/fsdp2 throughput {o['tok_s_per_gpu'] / f['tok_s_per_gpu']:.3f}, "
          f"peak memory {o['peak_gib'] / f['peak_gib']:.3f}")
PY
