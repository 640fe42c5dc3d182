#!/usr/bin/env bash
# Every benchmark in one go, for one GPU lease: the suite (all sizes x impls x repetitions, alternating),
# the step profile and memory breakdown of ours ZeRO-3 vs FSDP2 at 1.3B, and the CUDA-graph bench when
# fsdp_impl.cuda_graph exists; on a one-GPU machine also the suite at a fake world of 2 (one process as
# rank 0 of 2, collectives move nothing: each engine's world-2 step without communication). Writes at
# most 8 files, all directly in the output folder:
#   suite.jsonl suite.md trace.md timeline.png traces.tar graph.md log.txt [fake.md]
#
#   bash bench/gpu_all.sh [OUT_DIR]      (default: $OUT, else ./bench_out)
#
# Knobs (environment): BENCH_SIZES (1.3b,0.35b,2.7b: the target size first, so a cut budget costs the
# others), BENCH_IMPLS (all), BENCH_REPS (3), BENCH_STEPS (8), BENCH_WARMUP (3), BENCH_BUDGET_S (300:
# seconds from the suite's start after which it starts no cell), BENCH_TRACE (ours-z3,fsdp2; empty: no
# profile), BENCH_FAKE_WORLD (2 on a one-GPU machine, else empty: no fake-world pass), BENCH_FAKE_BUDGET_S
# (120), BENCH_GRAPH (1; 0 skips the CUDA-graph bench). Hard limits: suite + profile BENCH_BUDGET_S + 80 s, fake-world suite BENCH_FAKE_BUDGET_S + 40 s,
# graph bench 80 s, so the whole run ends within BENCH_BUDGET_S (+ BENCH_FAKE_BUDGET_S) + about 220 s:
# 8 minutes at the defaults (typically 6 to 6.5); with the fake pass BENCH_BUDGET_S defaults to 180.
# A megatron-fsdp wheel in .whl/ (megatron_fsdp-*.whl) is installed to /tmp and benchmarked too.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

out=${1:-${OUT:-bench_out}}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
start=$SECONDS
say() { echo "[gpu_all $((SECONDS - start))s] $*"; }

sizes=${BENCH_SIZES:-1.3b,0.35b,2.7b}
impls=${BENCH_IMPLS:-ours-z3,ours-z2,ours-hsdp,megatron-fsdp,fsdp2,fsdp2-noreshard,ddp,ceiling}
trace=${BENCH_TRACE-ours-z3,fsdp2}

ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
[ "$ngpu" -ge 1 ] || { say "no CUDA GPU visible: nothing to do"; exit 2; }
fake_world=${BENCH_FAKE_WORLD-$([ "$ngpu" -eq 1 ] && echo 2)}
fake_budget=${BENCH_FAKE_BUDGET_S:-120}
budget=${BENCH_BUDGET_S:-$([ -n "$fake_world" ] && echo 180 || echo 300)}
if compgen -G ".whl/megatron_fsdp-*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mfsdp_site \
        .whl/megatron_fsdp-*.whl && export PYTHONPATH=/tmp/mfsdp_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
say "$ngpu GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); torch $(python3 -c 'import torch; print(torch.__version__)'); megatron_fsdp: $(python3 -c 'import megatron_fsdp; print(megatron_fsdp.__version__)' 2>/dev/null || echo absent)"

say "suite: sizes $sizes, impls $impls, reps ${BENCH_REPS:-3}, budget ${budget}s; then profile: ${trace:-none}"
trace_args=()
[ -n "$trace" ] && trace_args=(--trace-impls "$trace" --trace-size 1.3b --trace-dir "$out")
timeout --signal=TERM --kill-after=10 $((budget + 80)) \
    torchrun --standalone --nproc-per-node "$ngpu" bench/suite.py --sizes "$sizes" --impls "$impls" \
    --reps "${BENCH_REPS:-3}" --steps "${BENCH_STEPS:-8}" --warmup "${BENCH_WARMUP:-3}" \
    --time-budget-s "$budget" --out "$out/suite.jsonl" --md "$out/suite.md" "${trace_args[@]}"
say "suite + profile exit status $?"
# Rebuild the table from whatever was measured (also after a crash or the time limit).
[ -s "$out/suite.jsonl" ] && python3 -m bench.report "$out/suite.jsonl" --md "$out/suite.md" >/dev/null

if [ -n "$fake_world" ]; then
    # DDP cannot run without real collectives; the ceiling has no communication to fake (the pass above has it)
    fake_impls=$(echo "$impls" | tr ',' '\n' | grep -v -x -e ddp -e ceiling | paste -sd, -)
    say "suite at fake world $fake_world (no communication): sizes $sizes, impls $fake_impls, budget ${fake_budget}s"
    timeout --signal=TERM --kill-after=10 $((fake_budget + 40)) \
        python3 bench/suite.py --fake-world "$fake_world" --sizes "$sizes" --impls "$fake_impls" \
        --reps "${BENCH_REPS:-3}" --steps "${BENCH_STEPS:-8}" --warmup "${BENCH_WARMUP:-3}" \
        --time-budget-s "$fake_budget" --out /tmp/fake_suite.jsonl --md "$out/fake.md"
    say "fake-world suite exit status $?"
    [ -s /tmp/fake_suite.jsonl ] && python3 -m bench.report /tmp/fake_suite.jsonl --md "$out/fake.md" >/dev/null
fi

if [ "${BENCH_GRAPH:-1}" = 0 ]; then
    say "CUDA-graph bench skipped (BENCH_GRAPH=0)"
elif python3 -c 'from fsdp_impl.cuda_graph import capture_train_step' 2>/dev/null; then
    say "CUDA-graph bench"
    timeout --signal=TERM --kill-after=10 80 \
        torchrun --standalone --nproc-per-node "$ngpu" bench/cuda_graph_bench.py --configs small,1.3b --md "$out/graph.md"
    say "graph bench exit status $?"
else
    python3 bench/cuda_graph_bench.py --md "$out/graph.md"
fi
# The lease returns at most 8 files: the traces travel as one tar.
traces=("$out"/trace_*.json.gz)
if [ -e "${traces[0]}" ]; then
    tar -C "$out" -cf "$out/traces.tar" "${traces[@]##*/}" && rm -f "${traces[@]}"
fi
say "done; files in $out: $(cd "$out" && ls | tr '\n' ' ')"
