#!/usr/bin/env bash
# Shared by every launch script (sourced, not run): GPU generation checks, capability
# variables, and the pytest call that writes JUnit XML. See launch_scripts/README.md.
#
# A tier script launch_scripts/<gen>/active/<tier>_<name>.sh does:
#   # GPU_COUNT=8          (header lines read by CI and by harness_init)
#   # CI_TIMEOUT=30        (minutes)
#   source "$(dirname "${BASH_SOURCE[0]}")/../../common.sh"
#   harness_init <gen> <xdist_workers>
#   harness_run_pytest <pytest selection...>

HARNESS_REPO_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HARNESS_GENERATIONS="cpu h100 h200 b200 gb200"
HARNESS_PYTEST_RC_NO_TESTS=5

harness_log() { echo "[harness] $*" >&2; }

# harness_require_int NAME VALUE MIN MAX [WHY]: succeed when VALUE is a whole number from MIN to MAX
# (leading zeros allowed, read as decimal); otherwise log an error naming the variable, its value, the
# range (and WHY, when given) and return 2. Checked before any arithmetic: bash would read "abc" as an unset variable (set -u) and
# "08" as bad octal.
harness_require_int() {
    local name=$1 value=$2 min=$3 max=$4 why=${5:-}
    if [[ "$value" =~ ^[0-9]{1,18}$ ]] && ((10#$value >= min && 10#$value <= max)); then
        return 0
    fi
    harness_log "ERROR: $name='$value' is not allowed: it must be a whole number from $min to $max${why:+ ($why)}"
    return 2
}

# Print the generation of a GPU from its nvidia-smi name and compute capability.
harness_gen_of_gpu() {
    local name=$1 cc=$2
    case "$name" in
        *GB200*) echo gb200 ;;
        *B200*) echo b200 ;;
        *H200*) echo h200 ;;
        *H100* | *H800*) echo h100 ;;
        *) echo "unknown(${name:-?}, sm_${cc:-?})" ;;
    esac
}

# Print "<gen> <count>" for the GPUs on this node, or "cpu 0" when there are none.
harness_detect_gpus() {
    local lines name cc gen first="" count=0
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        echo "cpu 0"
        return 0
    fi
    # Drivers older than R510 do not know compute_cap: fall back to the name alone.
    if ! lines=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null) &&
        ! lines=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null); then
        lines=""
    fi
    if [ -z "$lines" ]; then
        echo "cpu 0"
        return 0
    fi
    while IFS=, read -r name cc; do
        [ -n "$name" ] || continue
        gen=$(harness_gen_of_gpu "$name" "${cc// /}")
        if [ -z "$first" ]; then
            first=$gen
        elif [ "$gen" != "$first" ]; then
            first="mixed($first+$gen)"
        fi
        count=$((count + 1))
    done <<<"$lines"
    echo "${first:-cpu} $count"
}

# Export the capability variables that tests and requirement markers read.
harness_export_caps() {
    local gen=$1
    export HARNESS_CAP_FP8_MATMUL=0 HARNESS_CAP_MXFP8=0
    case "$gen" in
        h100 | h200) HARNESS_CAP_FP8_MATMUL=1 ;;          # sm_90: FP8 matmuls
        b200 | gb200) HARNESS_CAP_FP8_MATMUL=1 HARNESS_CAP_MXFP8=1 ;; # sm_100: + MXFP8
    esac
}

# Fail (or warn with HARNESS_ALLOW_GEN_MISMATCH=1) unless this node has >= count GPUs of gen.
harness_check_gpus() {
    local gen=$1 count=$2 found found_gen found_count problem=""
    [ "$gen" = cpu ] && return 0
    found=$(harness_detect_gpus)
    found_gen=${found% *}
    found_count=${found##* }
    if [ "$found_gen" != "$gen" ]; then
        problem="this script is for $gen GPUs but the node has: $found_gen ($found_count GPU(s))"
    elif [ "$found_count" -lt "$count" ]; then
        problem="this script needs $count $gen GPU(s) but the node has $found_count"
    fi
    [ -z "$problem" ] && return 0
    if [ "${HARNESS_ALLOW_GEN_MISMATCH:-0}" = 1 ]; then
        harness_log "WARNING: $problem (continuing: HARNESS_ALLOW_GEN_MISMATCH=1)"
        return 0
    fi
    harness_log "ERROR: $problem; set HARNESS_ALLOW_GEN_MISMATCH=1 to run anyway"
    return 3
}

# Print the integer value of header line "# KEY=N" of a script (empty if absent).
harness_header() {
    sed -n "s/^# $2=\([0-9][0-9]*\)[[:space:]]*\$/\1/p" "$1" | head -n 1
}

# harness_init GEN XDIST_WORKERS: called by a tier script; validates the generation,
# checks the node's GPUs against the script's GPU_COUNT header and exports the settings.
harness_init() {
    local gen=$1 workers=$2 script=${BASH_SOURCE[1]} count
    case " $HARNESS_GENERATIONS " in
        *" $gen "*) ;;
        *)
            harness_log "ERROR: unknown generation '$gen' (allowed: $HARNESS_GENERATIONS)"
            return 2
            ;;
    esac
    count=$(harness_header "$script" GPU_COUNT)
    if [ -z "$count" ]; then
        harness_log "ERROR: $script has no '# GPU_COUNT=<n>' header line"
        return 2
    fi
    harness_check_gpus "$gen" "$count" || return $?
    export HARNESS_GEN=$gen HARNESS_GPU_COUNT=$count
    export HARNESS_XDIST_WORKERS=${HARNESS_XDIST_WORKERS:-$workers}
    case "$HARNESS_XDIST_WORKERS" in
        '' | *[!0-9]*)
            harness_log "ERROR: HARNESS_XDIST_WORKERS must be a non-negative integer (got '$HARNESS_XDIST_WORKERS')"
            return 2
            ;;
    esac
    HARNESS_SCRIPT_NAME=$(basename "$script" .sh)
    export HARNESS_TIER=${HARNESS_SCRIPT_NAME%%_*}
    harness_export_caps "$gen"
    if [ "$gen" = cpu ]; then
        # The CPU backend even when GPUs exist: the harness reads HARNESS_FORCE_CPU, and
        # hiding the GPUs keeps anything else off them too.
        export HARNESS_FORCE_CPU=1 CUDA_VISIBLE_DEVICES=""
    fi
    cd "$HARNESS_REPO_ROOT" || return 2
}

# The interpreter: $PYTHON, else the repo's .venv, else python3.
harness_python() {
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
    elif [ -x "$HARNESS_REPO_ROOT/.venv/bin/python" ]; then
        echo "$HARNESS_REPO_ROOT/.venv/bin/python"
    else
        echo python3
    fi
}

# harness_marker_expr TIER EXPR...: print the one marker expression a script of TIER runs
# with: the given -m expressions joined with "and", plus "not slow" in L0 and L1 (tests
# marked slow run in L2 only). Empty when there is nothing to select on.
harness_marker_expr() {
    local tier=$1 part joined=""
    shift
    local -a parts=()
    for part in "$@"; do
        [ -n "$part" ] && parts+=("$part")
    done
    case "$tier" in
        L0 | L1)
            case " ${parts[*]-} " in
                *" not slow "*) ;;
                *) parts+=("not slow") ;;
            esac
            ;;
    esac
    for part in "${parts[@]+"${parts[@]}"}"; do
        # a compound expression keeps its own meaning inside the conjunction
        if [ "${#parts[@]}" -gt 1 ] && [[ "$part" == *" "* ]] && [ "$part" != "not slow" ]; then
            part="($part)"
        fi
        joined=${joined:+$joined and }$part
    done
    printf '%s' "$joined"
}

# harness_run_pytest ARGS...: run pytest on the selection ARGS, writing JUnit XML to
# ${HARNESS_OUT_DIR:-results}/<gen>/<script name>.xml. Every -m/--markexpr of ARGS and of
# HARNESS_PYTEST_ARGS becomes one -m (pytest would use only the last), where the first one
# stood, else before the selection; L0 and L1 add "not slow" to it (harness_marker_expr).
# Exit code 5 (nothing selected) counts as success with a warning.
harness_run_pytest() {
    local name=$HARNESS_SCRIPT_NAME out_dir xml python rc
    out_dir="${HARNESS_OUT_DIR:-results}/$HARNESS_GEN"
    xml="$out_dir/$name.xml"
    python=$(harness_python)
    local -a cmd=("$python" -m pytest -rfEs -o "junit_suite_name=$HARNESS_GEN/$name"
        "--junitxml=$xml")
    if [ "${HARNESS_XDIST_WORKERS:-1}" -gt 1 ]; then
        if "$python" -c 'import xdist' 2>/dev/null; then
            cmd+=(-n "$HARNESS_XDIST_WORKERS")
        else
            harness_log "WARNING: pytest-xdist not importable; running without -n"
        fi
    fi
    local -a extra=() args=() marks=()
    # shellcheck disable=SC2206  # HARNESS_PYTEST_ARGS is a word list on purpose
    [ -n "${HARNESS_PYTEST_ARGS:-}" ] && extra=($HARNESS_PYTEST_ARGS)
    set -- "$@" "${extra[@]+"${extra[@]}"}"
    local at=0 expr
    while [ $# -gt 0 ]; do
        case "$1" in
            -m | --markexpr)
                if [ $# -lt 2 ]; then
                    harness_log "ERROR: $1 needs a marker expression"
                    return 2
                fi
                marks+=("$2")
                shift
                ;;
            --markexpr=*) marks+=("${1#--markexpr=}") ;;
            -m?*) marks+=("${1#-m}") ;;
            *) args+=("$1") ;;
        esac
        shift
        if [ ${#marks[@]} -eq 0 ]; then
            at=${#args[@]} # the merged -m goes where the first one stood, else before the selection
        fi
    done
    if [ ${#marks[@]} -eq 0 ]; then
        at=0
    fi
    expr=$(harness_marker_expr "$HARNESS_TIER" "${marks[@]+"${marks[@]}"}")
    if [ -n "$expr" ]; then
        args=("${args[@]:0:at}" -m "$expr" "${args[@]:at}")
    fi
    cmd+=("${args[@]+"${args[@]}"}")
    harness_log "$HARNESS_GEN/$name: FP8_MATMUL=$HARNESS_CAP_FP8_MATMUL MXFP8=$HARNESS_CAP_MXFP8" \
        "GPUs=$HARNESS_GPU_COUNT xdist=$HARNESS_XDIST_WORKERS force_cpu=${HARNESS_FORCE_CPU:-0}"
    harness_log "running: $(printf '%q ' "${cmd[@]}")"
    if [ "${HARNESS_DRY_RUN:-0}" = 1 ]; then
        return 0
    fi
    mkdir -p "$out_dir"
    rc=0
    "${cmd[@]}" || rc=$?
    if [ "$rc" -eq "$HARNESS_PYTEST_RC_NO_TESTS" ]; then
        harness_log "WARNING: $HARNESS_GEN/$name selected no tests (pytest exit 5); counted as success"
        return 0
    fi
    return "$rc"
}
