#!/usr/bin/env bash
# Issue 29 on one GPU with TransformerEngine: do the FP8 bytes still equal TE's, how much host time
# do our FP8 hooks take per 1.3B step, and what does eager FP8 give. About 7 minutes on one H200.
#
#   bash bench/fp8_host_check.sh OUT_DIR        (on a GPU machine with TransformerEngine installed)
#
# Stages (each under `timeout`; a failing stage is reported and the next one runs):
#   1. tests.txt / tests.xml: the TE FP8 suites (byte equality with TE's own quantisation, losses
#      bit-identical to TE quantising bf16 weights, CUDA-graph FP8) and the CPU stand-in checks of
#      the batched host work;
#   2. hooks.md: `bench.host_profile --hooks` at 1.3B, world 1: calls and host ms per step in every
#      FP8 hook (ours-fp8-te-current; ours-z3 for the engine's bf16 hooks); target: "all FP8
#      hooks" <= 10 ms per step;
#   2b. hooks_base.md (only when a baseline is available): the same table for the engine with
#      fsdp_impl/fp8_te.py and fsdp_impl/fp8_params.py as of FP8_BASE_REF (default d3e962e, before
#      the batched host work), taken from git, or from FP8_BASE_DIR/fsdp_impl/{fp8_te,fp8_params}.py;
#   3. bench.md / bench.jsonl: `bench.fp8_bench` at 1.3B, each cell in its own process, alternating
#      repetitions, medians: ours-z3 (bf16) vs ours-fp8-te-current vs te-fp8-ref (TE alone, no
#      data parallelism), with the FP8 target lines.
# Knobs: FP8_CHECK_TESTS_S (200), FP8_CHECK_HOOKS_S (150 per table), FP8_CHECK_BENCH_S (330),
# FP8_CHECK_IMPLS (ours-z3,ours-fp8-te-current,te-fp8-ref), FP8_CHECK_REPS (3), FP8_CHECK_STEPS (6),
# FP8_CHECK_SIZE (1.3b), FP8_CHECK_HOOK_IMPLS (ours-fp8-te-current,ours-z3; the baseline: the first), FP8_BASE_REF, FP8_BASE_DIR (empty FP8_BASE_REF and no FP8_BASE_DIR: no 2b).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
[[ $py == */* ]] && py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")  # the baseline stage runs elsewhere
out=${1:-fp8_host_check_out}
mkdir -p "$out"
out=$(cd "$out" && pwd)
exec > >(tee -a "$out/log.txt") 2>&1
start=$SECONDS
say() { echo "[fp8_host_check $((SECONDS - start))s] $*"; }
run_stage() {  # run_stage NAME SECONDS cmd...: the command under timeout, its status reported
    local name=$1 secs=$2; shift 2
    say "stage $name (timeout ${secs}s): $*"
    timeout --signal=TERM --kill-after=20 "$secs" "$@"
    local rc=$?
    say "stage $name: exit $rc$([ $rc -eq 124 ] && echo ' (timed out)')"
    echo "$name $rc" >> "$out/status.txt"
    return 0
}
size=${FP8_CHECK_SIZE:-1.3b}
: > "$out/status.txt"
"$py" -c 'import torch, transformer_engine.pytorch as te; print("torch", torch.__version__, "TE", te.__version__, torch.cuda.get_device_name())' \
    || say "TransformerEngine or CUDA not usable here: the TE cells and tests will skip"

# 1. tests
run_stage tests "${FP8_CHECK_TESTS_S:-200}" "$py" -m pytest tests/functional/test_fp8_te.py \
    tests/functional/test_fp8_te_cast.py tests/functional/test_fp8_te_seed.py tests/functional/test_cuda_graph_fp8.py \
    tests/functional/test_fp8_te_host_work.py tests/functional/test_fp8_te_standin.py \
    -q -x -p no:cacheprovider -rs --junitxml "$out/tests.xml" > "$out/tests.txt" 2>&1
tail -15 "$out/tests.txt"

# 2. host time per FP8 hook
hook_impls=${FP8_CHECK_HOOK_IMPLS:-ours-fp8-te-current,ours-z3}
hooks=(-m bench.host_profile --impls "$hook_impls" --size "$size" --hooks --steps 5 --warmup 3)
run_stage hooks "${FP8_CHECK_HOOKS_S:-150}" "$py" "${hooks[@]}" > "$out/hooks.md" 2>&1
grep -E '^(====|\| )' "$out/hooks.md" | head -40

# 2b. the same before the batched host work (the engine's two FP8 files swapped back)
base_ref=${FP8_BASE_REF-d3e962e}
base=""
if [ -n "${FP8_BASE_DIR:-}" ] && [ -f "$FP8_BASE_DIR/fsdp_impl/fp8_te.py" ]; then
    base=$FP8_BASE_DIR
elif [ -n "$base_ref" ] && git rev-parse --verify -q "$base_ref^{commit}" > /dev/null 2>&1; then
    base=$(mktemp -d /tmp/fp8_base.XXXXXX)
    mkdir -p "$base/fsdp_impl"
    git show "$base_ref:fsdp_impl/fp8_te.py" > "$base/fsdp_impl/fp8_te.py" \
        && git show "$base_ref:fsdp_impl/fp8_params.py" > "$base/fsdp_impl/fp8_params.py" || base=""
fi
if [ -n "$base" ]; then
    tree=$(mktemp -d /tmp/fp8_base_tree.XXXXXX)
    cp -r fsdp_impl bench harness "$tree"/ 2>/dev/null; cp -f pyproject.toml "$tree"/ 2>/dev/null
    # the two files now live in fsdp_impl/fp8/ as te.py and params.py: one package level down
    for f in te params; do
        sed -E -e 's/^( *)from \.( |[A-Za-z_])/\1from ..\2/' -e 's/^( *)from \.\.fp8\./\1from ./' \
            -e 's/^( *)from \.\.fp8_(te|params) import/\1from .\2 import/' \
            "$base/fsdp_impl/fp8_$f.py" > "$tree/fsdp_impl/fp8/$f.py"
    done
    (cd "$tree" && run_stage hooks_base "${FP8_CHECK_HOOKS_S:-150}" "$py" -m bench.host_profile \
        --impls "${hook_impls%%,*}" --size "$size" --hooks --steps 5 --warmup 3 > "$out/hooks_base.md" 2>&1)
    grep -E '^(====|\| )' "$out/hooks_base.md" | head -20
else
    say "stage hooks_base skipped: no baseline (no git history for '$base_ref' here, FP8_BASE_DIR unset)"
fi

# 3. throughput: bf16 vs FP8 vs TE alone, each cell in its own process
run_stage bench "${FP8_CHECK_BENCH_S:-330}" "$py" -m bench.fp8_bench --sizes "$size" \
    --impls "${FP8_CHECK_IMPLS:-ours-z3,ours-fp8-te-current,te-fp8-ref}" --reps "${FP8_CHECK_REPS:-3}" \
    --steps "${FP8_CHECK_STEPS:-6}" --warmup 3 --time-budget-s $(( ${FP8_CHECK_BENCH_S:-330} > 180 ? ${FP8_CHECK_BENCH_S:-330} - 90 : ${FP8_CHECK_BENCH_S:-330} / 2 )) \
    --cell-timeout-s 150 --out "$out/bench.jsonl" --md "$out/bench.md"
[ -f "$out/bench.md" ] && cat "$out/bench.md"
say "done; stage exit codes:"
cat "$out/status.txt"
