"""The sign-off verdict: PASS only when every rule holds; each rule says what it checked and why it failed.

Only gating runs count (tests of ``flaky/`` scripts are reported, never gating). A run in which
nothing ran is not a PASS: skips are honest, but a sign-off needs tests that ran and passed.

The rules, in the report's order: ``rules`` below (tests ran, every run ran, no failures, nothing
left unrun, required regressions, no mutant), then golden values and checkpoint compatibility
(``golden_view``), and with a bench result the figures rule (``figures_rule``: every figure is
finite and positive) and speed vs baseline (``speed``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from harness.report.junit_read import Counts
from harness.report.regressions import RegressionRow
from harness.report.runs import Run


@dataclasses.dataclass(frozen=True)
class Rule:
    """One verdict rule: a short name, what it requires, whether it held, and the evidence."""

    name: str
    requires: str
    ok: bool
    detail: str


def _nothing_ran(counts: Counts) -> str | None:
    if counts.total == 0:
        return "no test results"
    if counts.passed == 0:  # a flaky test never counts as passed
        if counts.ran == 0:
            return f"all {counts.total} test(s) were skipped or never ran"
        return "no test passed"
    return None


def _run_problem(run: Run) -> str | None:
    counts = Counts.of(run.cases)
    if run.source == "(missing)":
        return "produced no results"
    empty = _nothing_ran(counts)
    if empty:
        return empty
    if not run.complete:
        return "did not finish (no JUnit XML; rebuilt from its journal)"
    return None


def rules(runs: Sequence[Run], rows: Sequence[RegressionRow]) -> list[Rule]:
    """Every verdict rule, in the order the report lists them."""
    gating = [r for r in runs if r.gating]
    cases = [c for r in gating for c in r.cases]
    counts = Counts.of(cases)
    nothing = _nothing_ran(counts)
    bad_runs = [f"`{r.label}` {p}" for r in gating if (p := _run_problem(r))]
    blocked = [f"`{r.bug_id}` is {r.status}" for r in rows if r.blocks_signoff]
    mutants = sorted({f"`{r.label}` ran with HARNESS_MUTANT={r.mutant}" for r in runs if r.mutant})
    failing = []
    if counts.failed:
        failing.append(f"{counts.failed} test(s) failed")
    if counts.error:
        failing.append(f"{counts.error} test(s) errored")
    return [
        Rule("tests ran", "at least one test ran and passed (an all-skipped or empty run is not a PASS)",
             nothing is None, nothing or f"{counts.passed} of {counts.total} passed"),
        Rule("every run ran", "every gating run produced results, finished, and passed at least one test",
             not bad_runs, "; ".join(bad_runs) or f"{len(gating)} run(s) ok"),
        Rule("no failures", "no test failed or errored (a crashed or hung test is an error)",
             not failing, "; ".join(failing) or "none"),
        Rule("nothing left unrun", "every collected test ran (none left 'not run' by a crash, a hang or a stop)",
             counts.not_run == 0, f"{counts.not_run} test(s) never ran" if counts.not_run else "none"),
        Rule("required regressions", "every required known bug has a passing regression test",
             not blocked, "; ".join(blocked) or f"{sum(r.required for r in rows)} required, all passed"),
        Rule("no mutant", "the runs tested the real code (no HARNESS_MUTANT was applied)",
             not mutants, "; ".join(mutants) or "none"),
    ]


def notes(runs: Sequence[Run]) -> list[str]:
    """What the reader should know that does not decide the verdict."""
    out = []
    flaky = sum(c.outcome == "flaky" for r in runs if r.gating for c in r.cases)
    if flaky:
        out.append(f"{flaky} test(s) passed only on a rerun (flaky; not counted as passed, see Flaky tests)")
    quarantined = [r for r in runs if not r.gating]
    if quarantined:
        n = sum(len(r.cases) for r in quarantined)
        out.append(f"{len(quarantined)} flaky-script run(s) with {n} test(s) reported, not gating")
    return out


FIGURES_RULE = "figures finite and positive"
FIGURES_LISTED = 5  # bad figures named in the evidence; the speed section's rows show every one


def figures_rule(bad: Sequence[str], checked: str) -> Rule:
    """Every figure a comparison uses is a number it can use: NaN fails every threshold comparison
    (a NaN throughput would read as within the threshold), zero divides by zero, a negative
    throughput is nonsense. ``bad`` names each offending figure; ``checked`` says what was looked at."""
    shown = "; ".join(bad[:FIGURES_LISTED]) + (f"; and {len(bad) - FIGURES_LISTED} more" if len(bad) > FIGURES_LISTED
                                                  else "")
    return Rule(FIGURES_RULE, "every figure is finite and positive: each throughput (tok_s_per_gpu, ours and the "
                "reference) of the bench result and its baseline, and the baseline's ratios; peak memory and "
                "spreads finite and not negative (only when a bench result is given)", not bad,
                shown or f"{checked}: all finite and positive")


def verdict(rule_list: Sequence[Rule]) -> tuple[bool, list[str]]:
    """PASS when every rule holds; the reasons are the failed rules' evidence."""
    reasons = [f"{r.name}: {r.detail}" for r in rule_list if not r.ok]
    return not reasons, reasons
