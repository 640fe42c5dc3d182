"""Golden values and checkpoint compatibility as the sign-off sees them, read from JUnit properties.

A golden cell's comparison travels in the ``golden`` property (``harness.golden``); a test that loads
a checkpoint committed by an earlier version carries ``checkpoint_compat``. Both answer "what
changed since the last release", so their rules are strict: any drift, a missing golden file, a
rewrite under ``--golden-update`` (nothing was compared) or a compatibility test that did not pass
fails a gating run. Standard library only, like the rest of the report's reading side.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

from harness.report.junit_format import (
    CHECKPOINT_COMPAT_PROPERTY,
    GOLDEN_BAND,
    GOLDEN_COMPARISONS,
    GOLDEN_DRIFT,
    GOLDEN_EXACT,
    GOLDEN_MATCH,
    GOLDEN_MISSING,
    GOLDEN_PROPERTY,
    GOLDEN_STATUSES,
    GOLDEN_UPDATED,
    RANK_PROPERTY_RE,
)
from harness.report.junit_read import NOT_RUN, PASSED, SKIPPED, XFAILED, TestCase, one_line_cause
from harness.report.verdict import Rule

UNREADABLE = "unreadable"  # a ``golden`` property that is not the JSON harness.golden writes
NO_RESULT = "no result"  # a test of a golden module that failed before it recorded a comparison
STATUS_ORDER = (GOLDEN_DRIFT, GOLDEN_MISSING, UNREADABLE, NO_RESULT, GOLDEN_UPDATED, GOLDEN_MATCH)
UPDATE_COMMAND = "python -m pytest -m golden --golden-update '{nodeid}'"
MAX_PLOTS = 20  # drifting cells drawn (and whose curves summary.json carries); every curve is in details.json


@dataclasses.dataclass(frozen=True)
class SeriesView:
    """One per-step series of a cell: the run, the golden values and how far apart they are."""

    name: str
    run: list[float]
    golden: list[float] | None
    tolerance: float
    max_rel_drift: float | None  # None: not comparable (no golden values, or another length)
    first_drift_step: int | None

    @property
    def drifted(self) -> bool:
        return self.first_drift_step is not None


@dataclasses.dataclass(frozen=True)
class GoldenCell:
    """One golden comparison of one test in one run."""

    case: TestCase
    cell: str
    platform: str
    path: str
    status: str
    series: tuple[SeriesView, ...] = ()
    golden_versions: dict[str, str] = dataclasses.field(default_factory=dict)
    detail: str = ""
    comparison: str = GOLDEN_EXACT  # exact (same fingerprint) or band (the fingerprint differs)
    fingerprint_diff: tuple[str, ...] = ()  # how the run's fingerprint differs from the file's

    @property
    def ok(self) -> bool:
        return self.status == GOLDEN_MATCH

    @property
    def compared(self) -> str:
        """``exact``, or ``within band; fingerprint differs: torch 2.13.0+cpu (this run 2.14.1)``."""
        if self.comparison != GOLDEN_BAND:
            return "exact"
        return "within band; fingerprint differs: " + ("; ".join(self.fingerprint_diff) or "?")

    @property
    def update_command(self) -> str:
        return UPDATE_COMMAND.format(nodeid=self.case.test_id)


@dataclasses.dataclass(frozen=True)
class CompatRow:
    """One checkpoint-compatibility test: the committed fixture it loads, what it checks, its outcome
    and, when it continued a curve, that curve's golden comparison."""

    case: TestCase
    fixture: str
    check: str
    golden: GoldenCell | None

    @property
    def ok(self) -> bool:
        return self.case.outcome in (PASSED, SKIPPED, XFAILED) and (self.golden is None or self.golden.ok)


def _property_values(case: TestCase, name: str) -> list[str]:
    """Every ``name`` value, else those of the first rank that recorded ``rank<r>.name`` (a value
    the ranks did not all record alike)."""
    values = case.prop_values(name)
    if values:
        return values
    for key, _ in case.properties:
        head, _, tail = key.partition(".")
        if tail == name and RANK_PROPERTY_RE.match(head):
            return case.prop_values(key)
    return []


def _property(case: TestCase, name: str) -> str | None:
    """The first value of ``name`` (or of ``rank<r>.name``)."""
    values = _property_values(case, name)
    return values[0] if values else None


def _float(value: Any) -> float:
    return math.nan if value is None else float(value)


def _series(name: str, data: dict[str, Any]) -> SeriesView:
    golden = data.get("golden")
    drift = data.get("max_rel_drift")
    return SeriesView(name, [_float(v) for v in data.get("run") or []],
                      None if golden is None else [_float(v) for v in golden], float(data.get("tolerance") or 0.0),
                      None if drift is None else float(drift), data.get("first_drift_step"))


def _unreadable(case: TestCase, detail: str, data: dict[str, Any] | None = None) -> GoldenCell:
    """An UNREADABLE cell, named by what of it could be read."""
    cell, platform = (data or {}).get("cell"), (data or {}).get("platform")
    return GoldenCell(case, cell if isinstance(cell, str) and cell else case.bracket_id or case.name,
                      platform if isinstance(platform, str) and platform else "-", "", UNREADABLE, detail=detail)


def _cell(case: TestCase, raw: str) -> GoldenCell:
    """One ``golden`` property value; anything but the JSON object ``harness.golden`` writes, with
    one of its statuses, is UNREADABLE (a FAIL): an unknown status must never count as nothing.
    Keys the reader does not know are ignored (newer writers add fields)."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        return _unreadable(case, f"not JSON: {exc}")
    if not isinstance(data, dict):
        return _unreadable(case, f"not a JSON object but {type(data).__name__}: {raw[:80]}")
    status = data.get("status")
    if status not in GOLDEN_STATUSES:
        return _unreadable(case, f"unknown status {status!r} (the harness writes "
                           + ", ".join(GOLDEN_STATUSES) + ")", data)
    comparison = data.get("comparison", GOLDEN_EXACT)  # absent in comparisons recorded before fingerprints
    if comparison not in GOLDEN_COMPARISONS:
        return _unreadable(case, f"unknown comparison {comparison!r} (the harness writes "
                           + ", ".join(GOLDEN_COMPARISONS) + ")", data)
    try:
        series = tuple(_series(str(k), v) for k, v in data.get("series", {}).items())
        return GoldenCell(case, str(data["cell"]), str(data.get("platform", "?")), str(data.get("path", "")),
                          str(status), series,
                          {str(k): str(v) for k, v in (data.get("golden_versions") or {}).items()},
                          detail=str(data.get("problem") or ""), comparison=str(comparison),
                          fingerprint_diff=tuple(str(d) for d in data.get("fingerprint_diff") or ()))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return _unreadable(case, f"{type(exc).__name__}: {exc}", data)


def parse_goldens(case: TestCase) -> list[GoldenCell]:
    """Every golden comparison ``case`` recorded (a test may check several cells), in XML order."""
    return [_cell(case, raw) for raw in _property_values(case, GOLDEN_PROPERTY)]


def parse_golden(case: TestCase) -> GoldenCell | None:
    """The first golden comparison ``case`` recorded, or None when it recorded none."""
    cells = parse_goldens(case)
    return cells[0] if cells else None


def golden_cells(cases: Sequence[TestCase]) -> list[GoldenCell]:
    """Every golden comparison, problems first, and the tests of the same files that failed before
    comparing anything (a crash in a golden cell must not hide in the section; a checkpoint-
    compatibility test is the next section's)."""
    found = [g for case in cases for g in parse_goldens(case)]
    modules = {g.case.module_path for g in found}
    recorded = {id(g.case) for g in found}
    for case in cases:
        if id(case) in recorded or case.module_path not in modules or _property(case, CHECKPOINT_COMPAT_PROPERTY):
            continue
        if case.failing or case.outcome == NOT_RUN:
            found.append(GoldenCell(case, case.bracket_id or case.name, "-", "", NO_RESULT,
                                    detail=f"{case.outcome}: {one_line_cause(case)}"))
    order = {s: i for i, s in enumerate(STATUS_ORDER)}
    return sorted(found, key=lambda g: (order.get(g.status, 0), g.case.run, g.cell))


def compat_rows(cases: Sequence[TestCase], cells: Sequence[GoldenCell]) -> list[CompatRow]:
    """The tests marked ``checkpoint_compat``, with the golden curve each continued (if any)."""
    by_case: dict[int, GoldenCell] = {}
    for g in cells:
        by_case.setdefault(id(g.case), g)  # the first curve a compat test recorded
    rows = []
    for case in cases:
        raw = _property(case, CHECKPOINT_COMPAT_PROPERTY)
        if raw is None:
            continue
        try:
            data = json.loads(raw)
            fixture, check = str(data.get("fixture", "?")), str(data.get("check", ""))
        except (ValueError, AttributeError):
            fixture, check = raw, ""
        rows.append(CompatRow(case, fixture, check, by_case.get(id(case))))
    return sorted(rows, key=lambda r: (r.ok, r.case.run, r.fixture))


def _named(cells: Sequence[GoldenCell]) -> str:
    shown = ", ".join(f"`{g.cell}` ({g.platform}, {g.case.run})" for g in cells[:5])
    return shown + (f" and {len(cells) - 5} more" if len(cells) > 5 else "")


def golden_rule(cells: Sequence[GoldenCell]) -> Rule:
    """Every golden cell of the gating runs matches its reviewed file."""
    problems = []
    for status, words in ((GOLDEN_DRIFT, "drifted"), (GOLDEN_MISSING, "have no golden file"),
                          (UNREADABLE, "recorded an unreadable comparison"),
                          (NO_RESULT, "failed before comparing"),
                          (GOLDEN_UPDATED, "were rewritten with --golden-update (nothing compared)")):
        hit = [g for g in cells if g.status == status]
        if hit:
            first = f" (first: {hit[0].detail})" if status == UNREADABLE and hit[0].detail else ""
            problems.append(f"{len(hit)} {words}: {_named(hit)}{first}")
    unknown = [g for g in cells if g.status not in STATUS_ORDER]  # never dropped, whatever made them
    if unknown:
        problems.append(f"{len(unknown)} have an unknown status: {_named(unknown)}")
    matched = sum(g.ok for g in cells)
    banded = [g for g in cells if g.ok and g.comparison == GOLDEN_BAND]
    note = (f" ({len(banded)} within their band, not bit for bit: the fingerprint differs, first "
            f"`{banded[0].cell}`: {'; '.join(banded[0].fingerprint_diff)})" if banded else "")
    evidence = "; ".join(problems) or (f"{matched} golden cell(s) match{note}" if cells else "no golden cell ran")
    return Rule("golden values", "every golden cell matches its reviewed per-platform file (a drift, a missing "
                "file, an unreadable comparison or unknown status, or a --golden-update run is a FAIL)",
                not problems, evidence)


def compat_rule(rows: Sequence[CompatRow]) -> Rule:
    """Every checkpoint of an earlier version still loads (or is refused as it must be)."""
    bad = [r for r in rows if not r.ok]
    evidence = "; ".join(f"`{r.fixture}` ({r.case.run}): {r.case.outcome}" for r in bad[:5])
    if len(bad) > 5:
        evidence += f" and {len(bad) - 5} more"
    if not bad:
        evidence = f"{len(rows)} test(s) passed" if rows else "no checkpoint-compatibility test ran"
    return Rule("checkpoint compatibility", "every checkpoint-compatibility test passed (committed checkpoints "
                "load and continue their curves; an unknown format is refused)", not bad, evidence)


def drift_text(s: SeriesView) -> str:
    """``3.2e-07 @ step 1``, ``0`` (bit for bit), ``1e-09 (within 1e-08)`` or ``-`` (not comparable);
    within a band, the band is the tolerance."""
    if s.golden is None or s.max_rel_drift is None:
        return "-"
    if s.drifted:
        return f"{s.max_rel_drift:.3g} @ step {s.first_drift_step}"
    if s.max_rel_drift == 0:
        return "0"
    return f"{s.max_rel_drift:.3g} (within {s.tolerance:g})"


def plotted(cells: Sequence[GoldenCell]) -> list[GoldenCell]:
    """The drifting cells the report draws: the first ``MAX_PLOTS`` in report order."""
    return [g for g in cells if g.status == GOLDEN_DRIFT][:MAX_PLOTS]


def as_json(cell: GoldenCell, curves: bool = True) -> dict[str, Any]:
    """A cell for ``summary.json`` / ``details.json``: the curves only where they drifted (the
    reviewed file has the rest), and only with ``curves``."""
    series = {}
    for s in cell.series:
        entry: dict[str, Any] = {"tolerance": s.tolerance, "max_rel_drift": s.max_rel_drift,
                                 "first_drift_step": s.first_drift_step}
        if s.drifted and curves:
            entry.update(run=s.run, golden=s.golden)
        series[s.name] = entry
    return {"test": cell.case.test_id, "run": cell.case.run, "cell": cell.cell, "platform": cell.platform,
            "status": cell.status, "comparison": cell.comparison, "fingerprint_diff": list(cell.fingerprint_diff),
            "path": cell.path, "golden_versions": cell.golden_versions, "detail": cell.detail, "series": series}
