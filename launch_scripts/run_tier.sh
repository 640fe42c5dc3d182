#!/usr/bin/env bash
# Run every active script of one tier for one GPU generation, then the sign-off report.
#
#   launch_scripts/run_tier.sh L0|L1|L2 [--gen cpu|h100|h200|b200|gb200]
#
# The generation defaults to the one detected on this node (cpu when there is no GPU).
# L0 and L1 deselect tests marked slow (every script's pytest call adds "not slow" to its
# marker expression, see harness_run_pytest in common.sh); L2 runs them.
# JUnit XML (and each run's .harness.json sidecar) goes to ${HARNESS_OUT_DIR:-results}/<gen>/,
# the quarantined scripts' (launch_scripts/<gen>/flaky/) to .../flaky/<gen>/, the sign-off to
# ${HARNESS_OUT_DIR:-results}/signoff/ (report.md, report.html, summary.json, merged-junit.xml).
# Exit status: 0 when every active script succeeded and the sign-off verdict is PASS (flaky
# scripts never decide it), 1 otherwise, 2 on bad usage.
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
report_dir="$out_root/signoff"
for script in "${scripts[@]}"; do
    name=$(basename "$script" .sh)
    xml="$out_root/$gen/$name.xml"
    # never report a stale result as this run's (the sidecar and journal of an earlier run included)
    rm -f "$xml" "${xml%.xml}.harness.json" "${xml%.xml}.harness.jsonl"
    harness_log "=== $script"
    if ! bash "$script"; then
        failed+=("$name")
    fi
    if [ -f "$xml" ]; then
        junit+=(--junit "$xml")
    elif [ -f "${xml%.xml}.harness.jsonl" ]; then
        harness_log "WARNING: $script wrote no JUnit XML; its harness journal shows how far it got"
        junit+=(--junit "$xml")
        failed+=("$name(no JUnit)")
    else
        harness_log "WARNING: $script wrote no JUnit XML ($xml)"
        junit+=(--missing-run "$gen/$name")
        failed+=("$name(no JUnit)")
    fi
done

# Quarantined scripts (launch_scripts/<gen>/flaky/): run and reported, never gating.
shopt -s nullglob
flaky_scripts=(launch_scripts/"$gen"/flaky/"$tier"_*.sh)
shopt -u nullglob
for script in "${flaky_scripts[@]}"; do
    name=$(basename "$script" .sh)
    xml="$out_root/flaky/$gen/$name.xml"
    rm -f "$xml" "${xml%.xml}.harness.json" "${xml%.xml}.harness.jsonl"
    harness_log "=== $script (flaky: reported, not gating)"
    HARNESS_OUT_DIR="$out_root/flaky" bash "$script" || harness_log "flaky script $name failed (not gating)"
    if [ -f "$xml" ] || [ -f "${xml%.xml}.harness.jsonl" ]; then
        junit+=(--flaky-junit "$xml")
    fi
done

args=("${junit[@]}" --out-dir "$report_dir" --title "Sign-off: $tier on $gen")
required=${HARNESS_REQUIRED_REGRESSIONS-launch_scripts/known_bugs.txt}
[ -n "$required" ] && args+=(--require-regressions "$required")
if [ -n "${HARNESS_BASELINE:-}" ]; then
    # shellcheck disable=SC2206  # a word list of baseline files/directories
    baseline=($HARNESS_BASELINE)
    args+=(--baseline "${baseline[@]}")
fi
if [ -n "${HARNESS_MUTANTS_SUMMARY:-}" ]; then
    # shellcheck disable=SC2206  # a word list: a tier's summary and/or the golden cells' (runner --golden)
    summaries=($HARNESS_MUTANTS_SUMMARY)
    for summary in "${summaries[@]}"; do
        args+=(--mutants "$summary")
    done
fi
if [ -n "${HARNESS_BENCH:-}" ]; then
    # the bench is part of this tier: its speed against the generation's stored baseline gates the verdict
    args+=(--bench "$HARNESS_BENCH" --bench-baseline "${HARNESS_BENCH_BASELINE:-bench/baselines}")
fi
verdict=0
"$(harness_python)" -m harness.report.signoff "${args[@]}" || verdict=$?

if [ ${#failed[@]} -gt 0 ]; then
    harness_log "scripts that failed: ${failed[*]}"
fi
if [ "$verdict" -ne 0 ] || [ ${#failed[@]} -gt 0 ]; then
    harness_log "tier $tier on $gen: FAIL (report: $report_dir/report.md, report.html, summary.json)"
    exit 1
fi
harness_log "tier $tier on $gen: PASS (report: $report_dir/report.md, report.html, summary.json)"
