#!/usr/bin/env bash
# Mutation testing: run one tier once per mutant of tests/mutants/catalogue.py and report which
# mutants the suite killed (see tests/mutants/README.md).
#
#   bash launch_scripts/mutants.sh [L0|L1|L2] [--gen cpu|h100|h200|b200|gb200] [--narrow] [--only NAME]...
#
# Writes ${HARNESS_OUT_DIR:-results}/mutants/summary.json (harness-signoff --mutants reads it) and,
# per mutant, the logs and JUnit of its runs. Exit status: 0 when the kill rate reaches the
# tier's bar (L0 80 %, L1/L2 100 %), 1 otherwise, 2 on bad usage.
set -euo pipefail
# shellcheck source=common.sh source-path=SCRIPTDIR
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cd "$HARNESS_REPO_ROOT"

tier=L0
case "${1:-}" in
    L0 | L1 | L2)
        tier=$1
        shift
        ;;
esac
out="${HARNESS_OUT_DIR:-results}/mutants"
exec "$(harness_python)" -m tests.mutants.runner --tier "$tier" --out "$out" "$@"
