"""Everything the sign-off shows, computed once from the loaded runs; the Markdown, HTML and JSON
renderers only format a :class:`Report`."""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Any

from harness.report import matrix_view
from harness.report.diff import BaselineDiff, baseline_diff
from harness.report.golden_view import CompatRow, GoldenCell, compat_rows, compat_rule, golden_cells, golden_rule
from harness.report.junit_read import (
    FLAKY,
    NOT_RUN,
    SKIPPED,
    XFAILED,
    Counts,
    JunitError,
    TestCase,
    failing_ranks,
    one_line_cause,
)
from harness.report.regressions import RegressionRow, regression_rows
from harness.report.runs import Run
from harness.report.speed import SpeedView, speed_figures_rule, speed_rule
from harness.report.verdict import Rule, notes, rules, verdict

SLOWEST = 10
ENV_FIELDS = (  # (label, key path in the sidecar's environment)
    ("torch", "torch"), ("CUDA", "cuda"), ("NCCL", "nccl"), ("cuDNN", "cudnn"),
    ("TransformerEngine", "transformer_engine"), ("GPUs", "gpu_count"), ("GPU names", "gpu_names"),
    ("driver", "driver"), ("backend", "backend"), ("git commit", "git.commit"), ("git dirty", "git.dirty"),
    ("python", "python"), ("pytest", "pytest"), ("pytest-xdist", "xdist"), ("host", "host"),
    ("CPU count", "cpu_count"), ("HARNESS_* settings", "harness_env"),
)


@dataclasses.dataclass
class FailureRow:
    case: TestCase
    ranks: list[int]
    rank_states: str
    cause: str


@dataclasses.dataclass
class SkipGroup:
    reason: str
    cases: list[TestCase]


@dataclasses.dataclass
class Report:
    """The computed sign-off, in report order."""

    title: str
    generated: str
    sources: list[str]
    runs: list[Run]
    passed: bool
    reasons: list[str]
    rules: list[Rule]
    notes: list[str]
    counts: Counts
    diff: BaselineDiff | None
    baseline_sources: list[str]
    golden: list[GoldenCell]
    compat: list[CompatRow]
    speed: SpeedView | None
    matrix: matrix_view.MatrixView
    regressions: list[RegressionRow]
    failures: list[FailureRow]
    failures_per_rank: list[tuple[int, int]]
    flaky: list[TestCase]
    skips: list[SkipGroup]
    slowest: list[TestCase]
    buckets: list[dict[str, Any]]
    environment: list[tuple[str, list[str]]]  # (field, value per run)
    mutants: dict[str, Any] | None
    golden_mutants: dict[str, Any] | None = None  # the runner's --golden summary: the golden cells alone
    details_file: str | None = None  # where the full failure and golden lists go (harness-signoff sets it)

    @property
    def gating_cases(self) -> list[TestCase]:
        return [c for r in self.runs if r.gating for c in r.cases]

    def by(self, key: str) -> dict[str, list[TestCase]]:
        """Gating tests grouped by ``suite``, ``module_path`` or ``run``."""
        groups: dict[str, list[TestCase]] = defaultdict(list)
        for case in self.gating_cases:
            groups[getattr(case, key)].append(case)
        return dict(sorted(groups.items()))


def _rank_states(case: TestCase) -> str:
    if not case.ranks:
        return "-"
    counts = Counter(state for _, state, _ in case.ranks)
    return ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))


def failure_rows(cases: Sequence[TestCase]) -> tuple[list[FailureRow], list[tuple[int, int]]]:
    """Failing tests with their failing ranks and cause, and how many failures each rank had."""
    rows = [FailureRow(c, failing_ranks(c) or [r for r, s, _ in c.ranks if s not in ("passed", "skipped")],
                       _rank_states(c), one_line_cause(c))
            for c in sorted((c for c in cases if c.failing), key=lambda c: (c.run, c.test_id))]
    per_rank = Counter(rank for row in rows for rank in row.ranks)
    return rows, sorted(per_rank.items())


def skip_groups(cases: Sequence[TestCase]) -> list[SkipGroup]:
    """Skipped, xfailed and never-run tests grouped by reason, biggest group first."""
    groups: dict[str, list[TestCase]] = defaultdict(list)
    for case in cases:
        if case.outcome in (SKIPPED, XFAILED, NOT_RUN):
            groups[f"{case.outcome}: {one_line_cause(case)}"].append(case)
    return [SkipGroup(r, sorted(g, key=lambda c: (c.run, c.test_id)))
            for r, g in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def bucket_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Every bucket of every run, slowest first (its tests' wall time, start-ups included)."""
    rows = [dict(b, run=r.label, startup_total_s=round(sum(b.get("startup_s") or []), 3))
            for r in runs for b in r.buckets]
    return sorted(rows, key=lambda b: -float(b.get("duration_s") or 0.0))


def _lookup(env: dict[str, Any], path: str) -> str:
    value: Any = env
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None or value == [] or value == {}:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{k}={v}" for k, v in value.items())
    if isinstance(value, list):
        return ", ".join(f"{n} x {name}" for name, n in Counter(map(str, value)).items())
    return str(value)


def environment_rows(runs: Sequence[Run]) -> list[tuple[str, list[str]]]:
    return [(label, [_lookup(r.environment, path) for r in runs]) for label, path in ENV_FIELDS]


GOLDEN_TIER = "golden"  # the mutation runner's --golden mode (tests.mutants.runner)


def read_mutants(path: pathlib.Path) -> dict[str, Any]:
    """The mutation runner's summary (``tests/mutants``): tier, and per mutant status and killers."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise JunitError(f"cannot read --mutants file {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("mutants"), list):
        raise JunitError(f"{path}: expected a JSON object with a 'mutants' list")
    return data


def split_mutants(summaries: Sequence[dict[str, Any]]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the tier's summary, the golden cells' summary): at most one of each."""
    tiers = [s for s in summaries if s.get("tier") != GOLDEN_TIER]
    golden = [s for s in summaries if s.get("tier") == GOLDEN_TIER]
    if len(tiers) > 1 or len(golden) > 1:
        raise JunitError("give at most one --mutants summary of a tier and one of the golden cells (--golden)")
    return (tiers[0] if tiers else None), (golden[0] if golden else None)


def gpu_only_here(golden_mutants: dict[str, Any]) -> list[str]:
    """Numerics-changing mutants whose numbers change only on GPUs, when the run was on CPU."""
    if golden_mutants.get("gen") != "cpu":
        return []
    return [m["name"] for m in golden_mutants["mutants"] if m.get("numerics") and m.get("numerics_gpu_only")]


def numerics_survivors(golden_mutants: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Mutants that change numerics where the golden cells ran, but survived them."""
    if golden_mutants is None:
        return []
    skip = set(gpu_only_here(golden_mutants))
    return [m for m in golden_mutants["mutants"]
            if m.get("numerics") and m.get("status") != "killed" and m.get("name") not in skip]


def _notes(runs: list[Run], speed: SpeedView | None, golden_mutants: dict[str, Any] | None) -> list[str]:
    out = notes(runs)
    if speed is not None:
        out += [f"speed: {n}" for n in speed.notes]
    survivors = numerics_survivors(golden_mutants)
    if survivors:
        out.append("numerics-changing mutant(s) the golden cells do not kill: "
                   + ", ".join(f"`{m['name']}`" for m in survivors) + " (see Mutation testing)")
    return out


def build_report(title: str, runs: list[Run], required: dict[str, str], baseline: list[TestCase] | None,
                 sources: Sequence[str], baseline_sources: Sequence[str] = (), diff_limit: int = 20,
                 mutants: dict[str, Any] | None = None, speed: SpeedView | None = None,
                 golden_mutants: dict[str, Any] | None = None) -> Report:
    """Compute every section of the sign-off."""
    gating = [c for r in runs if r.gating for c in r.cases]
    rows = regression_rows(gating, required)
    golden = golden_cells(gating)
    compat = compat_rows(gating, golden)
    extra = [golden_rule(golden), compat_rule(compat),
             *([speed_figures_rule(speed), speed_rule(speed)] if speed is not None else [])]
    rule_list = rules(runs, rows) + extra
    passed, reasons = verdict(rule_list)
    failures, per_rank = failure_rows(gating)
    declared = next((r.matrix_axes for r in runs if r.matrix_axes), [])
    flaky = [c for r in runs for c in r.cases if c.outcome == FLAKY or not r.gating]
    return Report(
        title=title, generated=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        sources=list(sources), runs=runs, passed=passed, reasons=reasons, rules=rule_list,
        notes=_notes(runs, speed, golden_mutants), counts=Counts.of(gating),
        diff=baseline_diff(gating, baseline, diff_limit) if baseline is not None else None,
        baseline_sources=list(baseline_sources), golden=golden, compat=compat, speed=speed,
        matrix=matrix_view.build(gating, declared), regressions=rows,
        failures=failures, failures_per_rank=per_rank, flaky=sorted(flaky, key=lambda c: (c.run, c.test_id)),
        skips=skip_groups(gating), slowest=sorted(gating, key=lambda c: -c.seconds)[:SLOWEST],
        buckets=bucket_rows(runs)[:SLOWEST], environment=environment_rows(runs), mutants=mutants,
        golden_mutants=golden_mutants)
