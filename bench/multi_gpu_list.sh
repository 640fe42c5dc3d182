#!/usr/bin/env bash
# Issue 51's standing list for a machine of 2, 4 or 8 GPUs, in stages that each fit one device call
# (at most ~9 minutes: STAGE_SECONDS, default 540, bounds the stage; what finished is kept).
#
#   [source .te/install.sh;] bash bench/multi_gpu_list.sh STAGE OUT_DIR
#
# Stages, in the issue's order of value (GPUs needed):
#   golden   (2)  the world-2 golden cells made with --golden-update; only new or changed files come
#                 back, in OUT_DIR/golden/ as <gen>__<cell>.json (review, copy into tests/golden/<gen>/,
#                 commit)
#   l0       (2)  the GPU generation's L0 tier in full (TE where installed), sign-off in OUT_DIR/tier/
#   speed13  (2)  bench.suite at 1.3B, world 2: ours-z3 vs fsdp2, ours-z2 vs fsdp2-noreshard, +ac and
#                 +sac against FSDP2 with the same recompute; 2 alternating repetitions
#   speed27  (2)  the same at 2.7B
#   trace    (2)  one profiled step of each pair at 1.3B (exposed all-gather / reduce-scatter ms)
#   ub       (2)  NCCL user buffers at 1.3B: ours-z3, local registration, symmetric registration,
#                 then their profiles (registered kernels show under their own names)
#   graphs   (2)  the CUDA-graph world-2 cases and the TE FP8 suites at world 2 (their FP8-vs-bf16
#                 all-gather byte checks included), plus the FP8 bench at world 2
#   seed8    (8)  the seed matrix (tests/functional/seed) at 8 NCCL ranks under torchrun
#   l1       (4)  the L1 tier (HSDP/HFSDP on (2,2) included)
#   scale    (4+) ours-z3 and fsdp2 at 1.3B at world 2, 4 and 8 where the GPUs exist: per-GPU tokens/s
#                 against world 2 (target >= 0.95)
#
# Everything printed goes to OUT_DIR/STAGE.log too; the device tool returns at most 8 files two
# folders down, so each stage writes few files. NCCL_NVLS_ENABLE=0 as the device README asks.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
stage=${1:-}
out=${2:-}
if [ -z "$stage" ] || [ -z "$out" ]; then
    sed -n '2,24p' "$0" >&2
    exit 2
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$out"
exec > >(tee -a "$out/$stage.log") 2>&1
budget=${STAGE_SECONDS:-540}
start=$SECONDS
left() { echo $((budget - (SECONDS - start))); }
say() { echo "[multi_gpu_list $stage $((SECONDS - start))s] $*"; }
# `bounded CMD...`: CMD under the stage's remaining time (TERM, then KILL 20 s later)
bounded() {
    local s
    s=$(left)
    if [ "$s" -le 10 ]; then say "no time left for: $*"; return 124; fi
    timeout --signal=TERM --kill-after=20 "$s" "$@"
}
ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
need() {
    if [ "$ngpu" -lt "$1" ]; then
        say "needs $1 GPUs, $ngpu visible: stage skipped"
        exit 3
    fi
}
say "$ngpu GPU(s): $(nvidia-smi -L 2>/dev/null | head -1)"
suite() {  # suite NAME SIZES IMPLS [more bench.suite flags]
    local name=$1 sizes=$2 names=$3
    shift 3
    local cells=$(($(left) - 90))  # no cell starts in the last 90 s, which the running one may need
    [ "$cells" -ge 30 ] || cells=30
    bounded "$py" -m bench.suite --nproc-per-node 2 --sizes "$sizes" --impls "$names" --reps 2 \
        --time-budget-s "$cells" --out "$out/$name.jsonl" --md "$out/$name.md" "$@"
}
pairs=ours-z3,fsdp2,ours-z2,fsdp2-noreshard,ours-z3+ac,fsdp2+ac,ours-z3+sac,fsdp2+sac

case "$stage" in
    golden)
        need 2
        cp -r tests/golden "$out/golden_all"
        bounded "$py" -m pytest -q -rfEs -m golden --golden-update -k world2 tests/functional/test_golden.py \
            --golden-dir "$out/golden_all"
        mkdir -p "$out/golden"
        # only the new or changed files come back (each compared with the committed one)
        for f in "$out"/golden_all/*/*.json; do
            rel=${f#"$out/golden_all/"}
            cmp -s "$f" "tests/golden/$rel" 2>/dev/null || cp "$f" "$out/golden/${rel//\//__}"
        done
        rm -rf "$out/golden_all"
        ls -l "$out/golden"
        ;;
    l0)
        need 2
        HARNESS_OUT_DIR="$out/tier" bounded bash launch_scripts/run_tier.sh L0
        say "L0 tier exit status $?; sign-off: $out/tier/signoff/report.md"
        ;;
    speed13) need 2; suite suite_1.3b 1.3b "$pairs" ;;
    speed27) need 2; suite suite_2.7b 2.7b "$pairs" ;;
    trace)
        need 2
        bounded "$py" -m bench.trace --nproc-per-node 2 --size 1.3b --impls "$pairs" --out-dir "$out/trace"
        ;;
    ub)
        need 2
        suite suite_ub 1.3b ours-z3,ours-z3+ub-local,ours-z3+ub
        bounded "$py" -m bench.trace --nproc-per-node 2 --size 1.3b --impls ours-z3+ub-local,ours-z3+ub \
            --out-dir "$out/trace_ub"
        ;;
    graphs)
        need 2
        bounded "$py" -m pytest -q -rfEs tests/functional/test_cuda_graph.py -k world2 \
            --junitxml "$out/graphs.xml"
        bounded "$py" -m pytest -q -rfEs tests/functional/test_fp8_te.py tests/functional/test_fp8_te_seed.py \
            tests/functional/test_decoupled_grad_te.py -k "world2 or ws2 or mesh2" --junitxml "$out/fp8_te.xml"
        bounded "$py" -m bench.fp8_bench --nproc-per-node 2 --out "$out/fp8.jsonl" --md "$out/fp8.md"
        ;;
    seed8)
        need 8
        bounded torchrun --nproc-per-node 8 -m pytest -q -rfEs tests/functional/seed --junitxml "$out/seed8.xml"
        ;;
    l1)
        need 4
        HARNESS_OUT_DIR="$out/tier" bounded bash launch_scripts/run_tier.sh L1
        ;;
    scale)
        need 4
        for n in 2 4 8; do
            [ "$n" -le "$ngpu" ] || continue
            bounded "$py" -m bench.suite --nproc-per-node "$n" --sizes 1.3b --impls ours-z3,fsdp2 --reps 2 \
                --out "$out/scale_$n.jsonl" --md "$out/scale_$n.md"
        done
        ;;
    *)
        say "unknown stage '$stage'; allowed: golden l0 speed13 speed27 trace ub graphs seed8 l1 scale"
        exit 2
        ;;
esac
say "done (exit status of the last step: $?)"
