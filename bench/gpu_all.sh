#!/usr/bin/env bash
# Every benchmark in one go on this machine's GPUs: the suite (sizes x implementations x repetitions,
# alternating, every cell in a process of its own), the step profile and memory breakdown of ours
# ZeRO-3 vs FSDP2 at 1.3B (each implementation in its own process), and the CUDA-graph bench when
# fsdp_impl.cuda_graph exists; on a one-GPU machine also the suite at a fake world of 2 (one process as
# rank 0 of 2, collectives move nothing: each engine's world-2 step without communication).
#
#   bash bench/gpu_all.sh [OUT_DIR]      (default: ./bench_out)
#
# Writes into OUT_DIR:
#   log.txt                  everything printed, cell by cell
#   suite.jsonl, suite.md    the suite's rows (one per cell, skip or error) and its table
#   trace.md, timeline.png   the step profile and memory breakdown
#   trace_<impl>.json.gz     each profiled implementation's chrome trace (open in ui.perfetto.dev)
#   graph.md                 the CUDA-graph bench
#   fake.jsonl, fake.md      the fake-world suite (one-GPU machines)
#
# Knobs (environment): BENCH_SIZES (1.3b,0.35b,2.7b: the target size first, so a cut budget costs the
# others), BENCH_IMPLS (all), BENCH_REPS (3), BENCH_STEPS (8), BENCH_WARMUP (3), BENCH_TRACE
# (ours-z3,fsdp2; empty: no profile), BENCH_TRACE_SIZE (1.3b), BENCH_FAKE_WORLD (2 on a one-GPU machine, else empty: no fake-world
# pass), BENCH_GRAPH (1; 0 skips the CUDA-graph bench), BENCH_CELL_TIMEOUT_S (1200: a cell running
# longer is killed and recorded as an error). Time limits, for a machine you hold for a fixed time:
# BENCH_BUDGET_S / BENCH_FAKE_BUDGET_S (unset: no limit) make the suite / the fake-world suite start no
# cell after that many seconds and end the pass at most 180 s later; BENCH_GRAPH_TIMEOUT_S (600) ends
# the CUDA-graph bench. Each cell starts a fresh process (5-15 s before its timed steps), so the
# default three sizes x eight implementations x three repetitions take 20-40 minutes on one H200.
#
# Megatron-FSDP is benchmarked when `megatron_fsdp` is importable. BENCH_MEGATRON_WHEEL=path/to/
# megatron_fsdp-*.whl benchmarks a wheel without installing it into the environment (unpacked into a
# temporary directory for this run); a wheel in .whl/ (git-ignored) is picked up by default.
# TransformerEngine, when installed, is imported first in every process (bench.runtime.load_te_first).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

out=${1:-bench_out}
mkdir -p "$out"
exec > >(tee -a "$out/log.txt") 2>&1
start=$SECONDS
say() { echo "[gpu_all $((SECONDS - start))s] $*"; }
# `limited SECONDS cmd...`: cmd under `timeout` when SECONDS is set, else as it is.
limited() { local s=$1; shift; if [ -n "$s" ]; then timeout --signal=TERM --kill-after=30 "$s" "$@"; else "$@"; fi; }

sizes=${BENCH_SIZES:-1.3b,0.35b,2.7b}
impls=${BENCH_IMPLS:-ours-z3,ours-z2,ours-hsdp,megatron-fsdp,fsdp2,fsdp2-noreshard,ddp,ceiling}
trace=${BENCH_TRACE-ours-z3,fsdp2}
steps=(--reps "${BENCH_REPS:-3}" --steps "${BENCH_STEPS:-8}" --warmup "${BENCH_WARMUP:-3}"
       --cell-timeout-s "${BENCH_CELL_TIMEOUT_S:-1200}")

ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count())')
[ "$ngpu" -ge 1 ] || { say "no CUDA GPU visible: nothing to do"; exit 2; }
fake_world=${BENCH_FAKE_WORLD-$([ "$ngpu" -eq 1 ] && echo 2)}
budget=${BENCH_BUDGET_S:-}
fake_budget=${BENCH_FAKE_BUDGET_S:-}
wheel=${BENCH_MEGATRON_WHEEL:-$(compgen -G ".whl/megatron_fsdp-*.whl" | head -1)}
if [ -n "$wheel" ]; then
    site=$(mktemp -d /tmp/bench_mfsdp.XXXXXX)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" \
        && export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
say "$ngpu GPU(s): $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); $("$py" -m bench.probe | tail -1)"

say "suite: sizes $sizes, impls $impls, ${steps[*]}, budget ${budget:-none}; then profile: ${trace:-none}"
trace_args=()
[ -n "$trace" ] && trace_args=(--trace-impls "$trace" --trace-size "${BENCH_TRACE_SIZE:-1.3b}" --trace-dir "$out")
limited "${budget:+$((budget + 180))}" "$py" -m bench.suite --nproc-per-node "$ngpu" --sizes "$sizes" \
    --impls "$impls" "${steps[@]}" ${budget:+--time-budget-s "$budget"} --out "$out/suite.jsonl" \
    --md "$out/suite.md" "${trace_args[@]}"
say "suite + profile exit status $?"
# Rebuild the table from whatever was measured (also after a crash or the time limit).
[ -s "$out/suite.jsonl" ] && "$py" -m bench.report "$out/suite.jsonl" --md "$out/suite.md" >/dev/null

if [ -n "$fake_world" ]; then
    # DDP cannot run without real collectives; the ceiling has no communication to fake (the pass above has it)
    fake_impls=$(echo "$impls" | tr ',' '\n' | grep -v -x -e ddp -e ceiling | paste -sd, -)
    say "suite at fake world $fake_world (no communication): sizes $sizes, impls $fake_impls, budget ${fake_budget:-none}"
    limited "${fake_budget:+$((fake_budget + 180))}" "$py" -m bench.suite --fake-world "$fake_world" \
        --sizes "$sizes" --impls "$fake_impls" "${steps[@]}" ${fake_budget:+--time-budget-s "$fake_budget"} \
        --out "$out/fake.jsonl" --md "$out/fake.md"
    say "fake-world suite exit status $?"
    [ -s "$out/fake.jsonl" ] && "$py" -m bench.report "$out/fake.jsonl" --md "$out/fake.md" >/dev/null
fi

if [ "${BENCH_GRAPH:-1}" = 0 ]; then
    say "CUDA-graph bench skipped (BENCH_GRAPH=0)"
elif "$py" -c 'from fsdp_impl.cuda_graph import capture_train_step' 2>/dev/null; then
    say "CUDA-graph bench"
    limited "${BENCH_GRAPH_TIMEOUT_S:-600}" "$py" -m torch.distributed.run --standalone --nproc-per-node "$ngpu" \
        -m bench.cuda_graph_bench --configs small,1.3b --md "$out/graph.md"
    say "graph bench exit status $?"
else
    "$py" -m bench.cuda_graph_bench --md "$out/graph.md"
fi
say "done; files in $out: $(cd "$out" && printf '%s ' *)"
