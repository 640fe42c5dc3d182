"""The sign-off as JSON: ``summary.json``, the same content for dashboards and scripts, and
``details.json``, every failure and every golden cell with its curves.

Both long lists are capped in ``summary.json`` as in the report (``MAX_LISTED`` failures and golden
cells, the curves of the ``MAX_PLOTS`` plotted cells only; ``failures_total`` and ``golden_total``
count them all), so 10,000 failing tests or drifting cells cannot make a file of tens of megabytes
(3,000 drifting cells x 300 steps made 91 MB); ``details.json`` (``details``) holds them all,
once."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from harness.report import golden_view
from harness.report.diff import Capped
from harness.report.document import MAX_LISTED
from harness.report.junit_read import Counts, TestCase, one_line_cause
from harness.report.sections import Report
from harness.report.speed import SpeedView


def _test(case: TestCase) -> dict[str, Any]:
    return {"id": case.test_id, "run": case.run, "outcome": case.outcome}


def _capped(capped: Capped) -> dict[str, Any]:
    return {"total": capped.total, "shown": capped.shown}


def _speed(view: SpeedView | None) -> dict[str, Any] | None:
    if view is None:
        return None
    rows = [{"size": r.size, "impl": r.impl, "status": r.status, "change": r.change, "threshold": r.threshold,
             "memory_change": r.memory_change, "baseline": r.base,
             "now": None if r.now is None else dataclasses.asdict(r.now)} for r in view.rows]
    return {"bench": view.bench, "baseline": view.baseline_path, "threshold_source": view.threshold_source,
            "problems": view.problems, "notes": view.notes, "cells": rows}


def _failures(rep: Report, limit: int | None) -> list[dict[str, Any]]:
    return [{**_test(f.case), "ranks": f.ranks, "rank_states": f.rank_states, "cause": f.cause}
            for f in rep.failures[:limit]]


def _golden(rep: Report, limit: int | None, curves_of: list[golden_view.GoldenCell] | None) -> list[dict[str, Any]]:
    """The first ``limit`` cells; curves for those in ``curves_of`` (every drifting one when None)."""
    drawn = None if curves_of is None else {id(g) for g in curves_of}
    return [golden_view.as_json(g, curves=drawn is None or id(g) in drawn) for g in rep.golden[:limit]]


def details(rep: Report) -> dict[str, Any]:
    """``details.json``: every failing test and every golden cell with its drifting curves."""
    return {"title": rep.title, "generated": rep.generated, "verdict": "PASS" if rep.passed else "FAIL",
            "failures": _failures(rep, None), "golden": _golden(rep, None, None)}


def summary(rep: Report) -> dict[str, Any]:
    m = rep.matrix
    diff = None
    if rep.diff is not None:
        d = rep.diff
        diff = {"sources": rep.baseline_sources, "limit": d.limit, "new_failures": _capped(d.new_failures),
                "fixes": _capped(d.fixes), "newly_skipped": _capped(d.newly_skipped),
                "vanished": _capped(d.vanished), "added": _capped(d.added),
                "other_changes": _capped(d.other_changes),
                "skip_rise": [{"run": r, "before": b, "now": n} for r, b, n in d.skip_rise]}
    cells = []
    for (row, col), cell in sorted(m.cells.items()):
        axes = dict(zip(m.row_axes, row, strict=True))
        if m.column_axis is not None:
            axes[m.column_axis] = col
        cells.append({"axes": axes, "outcome": cell.outcome, "tests": [_test(c) for c in cell.cases]})
    return {
        "title": rep.title, "generated": rep.generated, "sources": rep.sources,
        "verdict": "PASS" if rep.passed else "FAIL", "reasons": rep.reasons, "notes": rep.notes,
        "rules": [dataclasses.asdict(r) for r in rep.rules], "counts": rep.counts.as_dict(),
        "runs": [{"label": r.label, "source": r.source, "gating": r.gating, "complete": r.complete,
                  "mutant": r.mutant, "problems": r.problems, "counts": Counts.of(r.cases).as_dict()}
                 for r in rep.runs],
        "suites": {s: Counts.of(g).as_dict() for s, g in rep.by("suite").items()},
        "baseline": diff,
        "details": rep.details_file,
        "golden": _golden(rep, MAX_LISTED, golden_view.plotted(rep.golden)), "golden_total": len(rep.golden),
        "checkpoint_compat": [{**_test(r.case), "fixture": r.fixture, "check": r.check, "ok": r.ok,
                               "curve": None if r.golden is None else r.golden.status} for r in rep.compat],
        "speed": _speed(rep.speed),
        "matrix": {"axes": m.axes, "column_axis": m.column_axis, "cell_counts": m.cell_counts(), "cells": cells},
        "regressions": [{"bug_id": r.bug_id, "description": r.description, "required": r.required,
                         "status": r.status, "tests": [_test(c) for c in r.cases]} for r in rep.regressions],
        "failures": _failures(rep, MAX_LISTED), "failures_total": len(rep.failures),
        "failures_per_rank": {str(r): n for r, n in rep.failures_per_rank},
        "flaky": [{**_test(c), "gating": c.gating, "detail": one_line_cause(c)} for c in rep.flaky],
        "skips": [{"reason": g.reason, "count": len(g.cases), "tests": [c.test_id for c in g.cases]}
                  for g in rep.skips],
        "slowest": [{**_test(c), "seconds": round(c.seconds, 3)} for c in rep.slowest],
        "buckets": rep.buckets,
        "environment": {r.label: r.environment for r in rep.runs},
        "mutants": rep.mutants,
        "golden_mutants": rep.golden_mutants,
    }


def strict(value: Any) -> Any:
    """``value`` with every NaN or infinity as its text (``"nan"``, ``"inf"``): JSON has no such
    numbers, and Python's ``NaN`` literal breaks strict readers (a bad bench figure must not make
    the summary unreadable for the dashboards that should show it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(data: Any, indent: int | None = 1) -> str:
    """Strict JSON text of ``data`` (``strict``; anything else JSON cannot hold as its ``str``)."""
    return json.dumps(strict(data), indent=indent, default=str, allow_nan=False) + "\n"
