#!/usr/bin/env bash
# Shared by the Slurm templates launch_scripts/<gen>/slurm/run_tier.sbatch (sourced, not run):
# one tier across every node of a Slurm allocation, one sign-off. See launch_scripts/README.md.
#
#   sbatch --nodes=N launch_scripts/<gen>/slurm/run_tier.sbatch L0|L1|L2 [--dry-run]
#
# The batch script (on the allocation's first node) runs
#   srun --nodes=N --ntasks-per-node=1 torchrun --nnodes=N --nproc-per-node=P \
#        --rdzv-backend=c10d --rdzv-endpoint=<first node>:<port> ... -m pytest <selection>
# so every node runs one torchrun agent with P ranks; the agents meet through c10d rendezvous
# (torch assigns the node indices; global rank 0, which writes the one JUnit file, can land on
# any node, so every path is on the shared results directory), and then runs harness-signoff
# on that JUnit file. --dry-run prints both commands instead of running them.

# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

HARNESS_SLURM_DEFAULT_TESTS="tests/functional/test_multinode.py"

# harness_slurm_torchrun PYTHON: the torchrun next to PYTHON, else PYTHON -m torch.distributed.run.
harness_slurm_torchrun() {
    local python=$1 dir
    dir=$(dirname "$python")
    if [ "$dir" != . ] && [ -x "$dir/torchrun" ]; then
        echo "$dir/torchrun"
    else
        echo "$python -m torch.distributed.run"
    fi
}

# harness_slurm_head: the first host name of the allocation (the rendezvous endpoint).
harness_slurm_head() {
    if [ -n "${HARNESS_RDZV_HOST:-}" ]; then
        echo "$HARNESS_RDZV_HOST"
    elif [ -n "${SLURM_JOB_NODELIST:-}" ] && command -v scontrol >/dev/null 2>&1; then
        scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1
    else
        hostname
    fi
}

# harness_slurm_plan GEN GPUS_PER_NODE TIER: set the plan's variables (node count, endpoint,
# paths, the two command arrays) from the Slurm environment and the HARNESS_* settings.
harness_slurm_plan() {
    local gen=$1 gpus=$2 tier=$3 python expr out name torchrun
    harness_slurm_numbers "$gen" "$gpus" || return $?
    slurm_head=$(harness_slurm_head)
    out=${HARNESS_OUT_DIR:-results}
    case "$out" in /*) ;; *) out="$HARNESS_REPO_ROOT/$out" ;; esac
    name="${tier}_multinode"
    slurm_xml="$out/$gen/$name.xml"
    slurm_shared="$out/$gen/$name-job$slurm_job"
    slurm_signoff="$out/signoff-multinode"
    slurm_run="$gen/$name"
    python=$(harness_python)
    read -r -a torchrun <<<"$(harness_slurm_torchrun "$python")"
    # shellcheck disable=SC2206  # word lists on purpose
    local -a selection=(${HARNESS_SLURM_TESTS:-$HARNESS_SLURM_DEFAULT_TESTS}) extra=(${HARNESS_PYTEST_ARGS:-})
    expr=$(harness_marker_expr "$tier" "")
    slurm_srun=(srun "--nodes=$slurm_nnodes" --ntasks-per-node=1 --kill-on-bad-exit=1
        "${torchrun[@]}" "--nnodes=$slurm_nnodes" "--nproc-per-node=$slurm_nproc"
        --rdzv-backend=c10d "--rdzv-endpoint=$slurm_head:$slurm_port" "--rdzv-id=fsdp-harness-$slurm_job"
        "--rdzv-conf=join_timeout=$slurm_join" --max-restarts=0
        -m pytest -rfEs -p no:cacheprovider -o "junit_suite_name=$slurm_run" "--junitxml=$slurm_xml"
        "--harness-shared-dir=$slurm_shared")
    [ -n "$expr" ] && slurm_srun+=(-m "$expr")
    slurm_srun+=("${extra[@]+"${extra[@]}"}" "${selection[@]}")
    slurm_signoff_args=(--out-dir "$slurm_signoff"
        --title "Sign-off: $tier on $slurm_nnodes x $gen nodes ($slurm_nproc ranks each)")
    if [ -n "${HARNESS_REQUIRED_REGRESSIONS:-}" ]; then
        slurm_signoff_args+=(--require-regressions "$HARNESS_REQUIRED_REGRESSIONS")
    fi
    if [ -n "${HARNESS_BASELINE:-}" ]; then
        # shellcheck disable=SC2206  # a word list of baseline files/directories
        local -a baseline=($HARNESS_BASELINE)
        slurm_signoff_args+=(--baseline "${baseline[@]}")
    fi
    harness_slurm_signoff_cmd --junit "$slurm_xml"
}

# harness_slurm_numbers GEN GPUS_PER_NODE: read and check every number of the plan (slurm_nnodes,
# slurm_job, slurm_nproc, slurm_port, slurm_join) from the Slurm environment and the HARNESS_* settings;
# a bad one is an error naming the variable, its value and the allowed range (status 2), before
# anything runs: a node count of 0 would print "world 0", and a GPU generation with more ranks per
# node than GPUs would leave ranks without a GPU, so the harness would fall back to gloo.
harness_slurm_numbers() {
    local gen=$1 gpus=$2 nodes_var=SLURM_NNODES max_nproc=$2 why="one rank per GPU, $2 GPUs per $1 node"
    if [ -z "${SLURM_NNODES:-}" ] && [ -n "${SLURM_JOB_NUM_NODES:-}" ]; then
        nodes_var=SLURM_JOB_NUM_NODES
    fi
    if [ "$gen" = cpu ]; then
        max_nproc=256 why=""
    fi
    slurm_nnodes=${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-2}}
    harness_require_int "$nodes_var" "$slurm_nnodes" 1 10000 || return 2
    slurm_job=${SLURM_JOB_ID:-0}
    harness_require_int SLURM_JOB_ID "$slurm_job" 0 4294967295 || return 2
    slurm_nproc=${HARNESS_NPROC_PER_NODE:-$gpus}
    harness_require_int HARNESS_NPROC_PER_NODE "$slurm_nproc" 1 "$max_nproc" "$why" || return 2
    slurm_port=${HARNESS_RDZV_PORT:-$((20000 + 10#$slurm_job % 20000))}
    harness_require_int HARNESS_RDZV_PORT "$slurm_port" 1 65535 || return 2
    slurm_join=${HARNESS_RDZV_JOIN_TIMEOUT:-600}
    harness_require_int HARNESS_RDZV_JOIN_TIMEOUT "$slurm_join" 1 86400 || return 2
    # As decimal numbers from here on ("08" stays 8).
    slurm_nnodes=$((10#$slurm_nnodes)) slurm_job=$((10#$slurm_job)) slurm_nproc=$((10#$slurm_nproc))
    slurm_port=$((10#$slurm_port)) slurm_join=$((10#$slurm_join))
}

# harness_slurm_signoff_cmd INPUT...: set slurm_signoff_cmd, the sign-off over INPUT
# (--junit FILE, or --missing-run RUN when the job left no results).
harness_slurm_signoff_cmd() {
    slurm_signoff_cmd=("$(harness_python)" -m harness.report.signoff "$@" "${slurm_signoff_args[@]}")
}

# harness_slurm_export GEN TIER: what the ranks read (srun passes the environment on).
harness_slurm_export() {
    local gen=$1 tier=$2
    # HARNESS_NNODES: the harness checks after the rendezvous that it formed this many nodes.
    export HARNESS_GEN=$gen HARNESS_TIER=$tier HARNESS_GPU_COUNT=$slurm_nproc HARNESS_NNODES=$slurm_nnodes
    harness_export_caps "$gen"
    if [ "$gen" = cpu ]; then
        export HARNESS_FORCE_CPU=1 CUDA_VISIBLE_DEVICES=""
    fi
    if [ "$tier" = L2 ]; then
        export HARNESS_FULL_MATRIX=1
    fi
}

# harness_slurm_no_results: say why there is no JUnit file; the rendezvous that never completed
# is told apart by the shared directory, where rank 0 creates the session as soon as pytest starts.
harness_slurm_no_results() {
    local rc=$1
    if compgen -G "$slurm_shared/torchrun-*" >/dev/null; then
        harness_log "ERROR: the ranks started but rank 0 wrote no JUnit file ($slurm_xml); srun exit $rc;" \
            "see the rank logs under $slurm_shared"
    else
        harness_log "ERROR: no rank started pytest: the torchrun rendezvous (c10d at" \
            "$slurm_head:$slurm_port, $slurm_nnodes nodes) did not complete within join_timeout=${slurm_join}s," \
            "or torchrun failed before it. A node never joined: look above for the node whose srun task" \
            "failed to start or could not reach $slurm_head:$slurm_port (srun exit $rc)"
    fi
}

# harness_slurm_run_tier GEN GPUS_PER_NODE TIER [--dry-run]: the body of every template.
harness_slurm_run_tier() {
    local gen=$1 gpus=$2 tier=${3:-} dry=0 rc=0 verdict=0 arg
    shift 2
    [ $# -gt 0 ] && shift
    for arg in "$@"; do
        case "$arg" in
            --dry-run) dry=1 ;;
            *)
                harness_log "ERROR: unknown argument '$arg' (usage: run_tier.sbatch L0|L1|L2 [--dry-run])"
                return 2
                ;;
        esac
    done
    case "$tier" in
        L0 | L1 | L2) ;;
        *)
            harness_log "ERROR: tier must be one of L0, L1, L2 (got '$tier')"
            return 2
            ;;
    esac
    if [ "$dry" = 0 ] && [ -z "${SLURM_JOB_ID:-}" ]; then
        harness_log "ERROR: not inside a Slurm job: submit with sbatch (or use --dry-run)"
        return 2
    fi
    cd "$HARNESS_REPO_ROOT" || return 2
    harness_slurm_plan "$gen" "$gpus" "$tier" || return $?
    harness_slurm_export "$gen" "$tier"
    harness_log "slurm: $tier on $slurm_nnodes x $gen nodes, $slurm_nproc ranks each (world" \
        "$((slurm_nnodes * slurm_nproc))); rendezvous c10d at $slurm_head:$slurm_port, join_timeout ${slurm_join}s"
    harness_log "running: $(printf '%q ' "${slurm_srun[@]}")"
    harness_log "then: $(printf '%q ' "${slurm_signoff_cmd[@]}")"
    if [ "$dry" = 1 ]; then
        return 0
    fi
    harness_check_gpus "$gen" "$slurm_nproc" || return $?
    mkdir -p "$(dirname "$slurm_xml")" "$slurm_shared"
    rm -f "$slurm_xml" "${slurm_xml%.xml}.harness.json" "${slurm_xml%.xml}.harness.jsonl"
    "${slurm_srun[@]}" || rc=$?
    if [ -f "$slurm_xml" ] || [ -f "${slurm_xml%.xml}.harness.jsonl" ]; then
        if [ "$rc" -ne 0 ]; then
            harness_log "srun exited $rc (a tier with failures does; the verdict below decides)"
        fi
    else
        harness_slurm_no_results "$rc"
        harness_slurm_signoff_cmd --missing-run "$slurm_run"
    fi
    "${slurm_signoff_cmd[@]}" || verdict=$?
    if [ "$verdict" -ne 0 ] || [ ! -f "$slurm_xml" ]; then
        harness_log "tier $tier on $slurm_nnodes x $gen nodes: FAIL (report: $slurm_signoff/report.md)"
        return 1
    fi
    harness_log "tier $tier on $slurm_nnodes x $gen nodes: PASS (report: $slurm_signoff/report.md)"
}
