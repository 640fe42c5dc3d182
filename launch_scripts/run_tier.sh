#!/usr/bin/env bash
# Run every active script of one tier for one GPU generation, then the sign-off report.
#
#   launch_scripts/run_tier.sh L0|L1|L2 [--gen cpu|h100|h200|b200|gb200]
#
# The generation defaults to the one detected on this node (cpu when there is no GPU).
# L0 and L1 deselect tests marked slow (every script's pytest call adds "not slow" to its
# marker expression, see harness_run_pytest in common.sh); L2 runs them.
# JUnit XML goes to ${HARNESS_OUT_DIR:-results}/<gen>/, the report to
# ${HARNESS_OUT_DIR:-results}/signoff.md. Exit status: 0 when every script succeeded and
# the sign-off verdict is PASS, 1 otherwise, 2 on bad usage.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() {
    echo "usage: $0 L0|L1|L2 [--gen ${HARNESS_GENERATIONS// /|}]" >&2
    exit 2
}

tier=${1:-}
[ $# -gt 0 ] && shift
case "$tier" in
    L0 | L1 | L2) ;;
    *)
        harness_log "ERROR: tier must be one of L0, L1, L2 (got '${tier}')"
        usage
        ;;
esac
gen=""
while [ $# -gt 0 ]; do
    case "$1" in
        --gen)
            [ $# -ge 2 ] || usage
            gen=$2
            shift 2
            ;;
        *)
            harness_log "ERROR: unknown argument '$1'"
            usage
            ;;
    esac
done
if [ -z "$gen" ]; then
    detected=$(harness_detect_gpus)
    gen=${detected% *}
    harness_log "detected generation: $gen (${detected##* } GPU(s))"
fi
case " $HARNESS_GENERATIONS " in
    *" $gen "*) ;;
    *)
        harness_log "ERROR: generation '$gen' is not one of: $HARNESS_GENERATIONS (use --gen)"
        exit 2
        ;;
esac

cd "$HARNESS_REPO_ROOT"
out_root=${HARNESS_OUT_DIR:-results}
shopt -s nullglob
scripts=(launch_scripts/"$gen"/active/"$tier"_*.sh)
shopt -u nullglob
if [ ${#scripts[@]} -eq 0 ]; then
    harness_log "ERROR: no active $tier scripts in launch_scripts/$gen/active/"
    exit 2
fi

case "$tier" in
    L0 | L1) harness_log "tier $tier: tests marked slow are deselected (they run in L2)" ;;
    L2) harness_log "tier L2: every test, slow ones included" ;;
esac

failed=()
junit=()
for script in "${scripts[@]}"; do
    name=$(basename "$script" .sh)
    xml="$out_root/$gen/$name.xml"
    rm -f "$xml" # never report a stale result as this run's
    harness_log "=== $script"
    if ! bash "$script"; then
        failed+=("$name")
    fi
    if [ -f "$xml" ]; then
        junit+=(--junit "$xml")
    else
        harness_log "WARNING: $script wrote no JUnit XML ($xml)"
        failed+=("$name(no JUnit)")
    fi
done

verdict=0
if [ ${#junit[@]} -gt 0 ]; then
    args=("${junit[@]}" --output "$out_root/signoff.md" --title "Sign-off: $tier on $gen")
    required=${HARNESS_REQUIRED_REGRESSIONS-launch_scripts/known_bugs.txt}
    [ -n "$required" ] && args+=(--require-regressions "$required")
    if [ -n "${HARNESS_BASELINE:-}" ]; then
        # shellcheck disable=SC2206  # a word list of baseline files/directories
        baseline=($HARNESS_BASELINE)
        args+=(--baseline "${baseline[@]}")
    fi
    "$(harness_python)" -m harness.report.signoff "${args[@]}" || verdict=$?
else
    harness_log "ERROR: no JUnit XML was produced; no sign-off report"
    verdict=1
fi

if [ ${#failed[@]} -gt 0 ]; then
    harness_log "scripts that failed: ${failed[*]}"
fi
if [ "$verdict" -ne 0 ] || [ ${#failed[@]} -gt 0 ]; then
    harness_log "tier $tier on $gen: FAIL (report: $out_root/signoff.md)"
    exit 1
fi
harness_log "tier $tier on $gen: PASS (report: $out_root/signoff.md)"
