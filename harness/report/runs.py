"""Load test runs for the sign-off: each JUnit file with its sidecar, or the journal of a run that died.

A run is what one pytest session wrote: ``<name>.xml`` and ``<name>.harness.json`` (or, for a
session killed before its end, only ``<name>.harness.jsonl``). Loading one merges the sidecar's
per-test details (exact node id, wall time, bucket, per-rank outcomes) into the JUnit records and
adds the records JUnit cannot hold:

- a test that started and never finished (the session crashed or a hang was killed) is an explicit
  ERROR case;
- a collected test that never reported is NOT RUN, counted apart from failures;
- a run that left nothing at all (``--missing-run``) is an ERROR case of its own.

A quarantined run (``--flaky-junit``, or a ``flaky`` directory inside a scanned results tree) is
non-gating: its tests are reported and never decide the verdict.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import junitparser

from harness.report.junit_format import AXIS_PROPERTY_PREFIX, NOT_RUN_TYPE, SYNTHESISED_PROPERTY
from harness.report.junit_read import (
    ERROR,
    NAMELESS_MESSAGE,
    NOT_RUN,
    OUTCOME_RANK,
    JunitError,
    PytestXml,
    TestCase,
    parse_junit_file,
    suite_run_label,
    to_case,
)
from harness.report.sidecar_format import (
    JOURNAL_SUFFIX,
    SIDECAR_SUFFIX,
    base_of,
    bucket_summary,
    strip_xdist_group,
)

CRASHED_TYPE = "harness.crashed"  # the <error type> of a synthesised crash case in merged JUnit
UNFINISHED_MESSAGE = ("started and never finished: the session ended without a result for this test "
                      "(a crash, a hang killed by a timeout, or a signal)")
NOT_RUN_MESSAGE = "collected but never ran: the session ended before it (crash, hang, -x/--maxfail or interrupt)"
MERGED_NAME = "harness-signoff merged"  # the merged JUnit's root name; directory scans skip such files


@dataclasses.dataclass
class Run:
    """One pytest session's results and what is known about where and how it ran."""

    label: str
    source: str
    cases: list[TestCase]
    environment: dict[str, Any] = dataclasses.field(default_factory=dict)
    buckets: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    matrix_axes: list[str] = dataclasses.field(default_factory=list)
    mutant: str | None = None
    gating: bool = True
    complete: bool = True
    problems: list[str] = dataclasses.field(default_factory=list)
    xml: PytestXml | None = None

    @property
    def synthesised(self) -> list[TestCase]:
        """Cases that exist only because the run did not report them (crashed, not run, missing)."""
        return [c for c in self.cases if c.prop(SYNTHESISED_PROPERTY)]


def mangle(nodeid: str) -> tuple[str, str]:
    """pytest junitxml's (classname, name) for a node id: ``a/b.py::C::t[x]`` -> (``a.b.C``, ``t[x]``)."""
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = re.sub(r"\.py$", "", names[0].replace("/", "."))
    names[-1] += bracket + params
    return ".".join(names[:-1]), names[-1]


def read_sidecar(base: pathlib.Path) -> dict[str, Any] | None:
    """The final sidecar of ``base``, else the run reconstructed from its journal, else None."""
    final = base.with_name(base.name + SIDECAR_SUFFIX)
    if final.exists():
        try:
            data = json.loads(final.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise JunitError(f"{final} is not a readable sidecar ({exc})") from None
        return data if isinstance(data, dict) else None
    journal = base.with_name(base.name + JOURNAL_SUFFIX)
    return read_journal(journal) if journal.exists() else None


def read_journal(path: pathlib.Path) -> dict[str, Any]:
    """Rebuild a sidecar from the journal of a session that did not finish (a torn last line is ignored)."""
    data: dict[str, Any] = {"complete": False, "tests": {}, "expected": [], "expected_axes": {}}
    started: dict[str, float] = {}
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        kind = event.pop("event", None)
        if kind == "start":
            data.update(event)
        elif kind == "collected":
            data["expected"], data["expected_axes"] = event.get("ids", []), event.get("axes", {})
        elif kind == "test_start":
            started[event["nodeid"]] = event.get("t", 0.0)
        elif kind == "test_end":
            data["tests"][event["nodeid"]] = event.get("record", {})
            started.pop(event["nodeid"], None)
    data["complete"] = False
    data["unfinished"] = sorted(started)
    data["buckets"] = bucket_summary(data["tests"])
    return data


def _with_sidecar(case: TestCase, nodeid: str, record: Mapping[str, Any], gating: bool) -> TestCase:
    ranks = tuple(sorted((int(r), str(v.get("outcome", "")), float(v.get("duration_s", 0.0)))
                         for r, v in (record.get("ranks") or {}).items()))
    bucket = (record.get("bucket") or {}).get("label")
    return dataclasses.replace(case, nodeid=nodeid, wall_s=record.get("wall_s"), bucket=bucket, ranks=ranks,
                               gating=gating)


def _synthetic(run: str, nodeid: str, outcome: str, message: str, axes: Mapping[str, str] | None = None,
               gating: bool = True) -> TestCase:
    classname, name = mangle(nodeid)
    axis_props = ((f"{AXIS_PROPERTY_PREFIX}{k}", str(v)) for k, v in (axes or {}).items())
    props = ((SYNTHESISED_PROPERTY, outcome), *axis_props)
    return TestCase(run=run, classname=classname, name=name, outcome=outcome, message=message,
                    properties=props, nodeid=nodeid, gating=gating)


def _from_record(run: str, nodeid: str, record: Mapping[str, Any], gating: bool) -> TestCase:
    """A test known only from the journal (no JUnit was written)."""
    outcome = str(record.get("outcome", ERROR))
    case = _synthetic(run, nodeid, outcome if outcome in OUTCOME_RANK else ERROR, str(record.get("message", "")),
                      record.get("axes"), gating)
    case = dataclasses.replace(case, time_s=float(record.get("duration_s", 0.0)),
                               properties=tuple(p for p in case.properties if p[0] != SYNTHESISED_PROPERTY))
    return _with_sidecar(case, nodeid, record, gating)


def build_run(label: str, source: str, xml: PytestXml | None, sidecar: Mapping[str, Any] | None,
              gating: bool) -> Run:
    """Merge a run's JUnit and sidecar; add crash, not-run and missing cases."""
    cases = [to_case(c, suite_run_label(s, label)) for s in xml for c in s] if xml is not None else []
    if sidecar is not None and sidecar.get("unfinished"):  # the sidecar names the interrupted test
        cases = [c for c in cases if c.message != NAMELESS_MESSAGE]
    run_label = cases[0].run if cases else label
    run = Run(run_label, source, [], gating=gating, xml=xml)
    if sidecar is None:
        run.cases = [dataclasses.replace(c, gating=gating) for c in cases]
        return run
    run.environment = dict(sidecar.get("environment") or {})
    run.buckets = list(sidecar.get("buckets") or [])
    run.matrix_axes = list(sidecar.get("matrix_axes") or [])
    run.mutant = sidecar.get("mutant")
    run.complete = bool(sidecar.get("complete", True)) and xml is not None
    tests: Mapping[str, Mapping[str, Any]] = sidecar.get("tests") or {}
    by_key = {mangle(nodeid): nodeid for nodeid in tests}
    merged, seen = [], set()
    for case in cases:
        nodeid = by_key.get((case.classname, case.name))
        if nodeid is None:
            merged.append(dataclasses.replace(case, gating=gating))
            continue
        seen.add(nodeid)
        merged.append(_with_sidecar(case, nodeid, tests[nodeid], gating))
    reported = {(c.classname, c.name) for c in cases}
    if xml is None:
        run.problems.append("no JUnit XML: the session did not finish; results rebuilt from the harness journal")
        for nodeid, record in tests.items():
            merged.append(_from_record(run_label, nodeid, record, gating))
            seen.add(nodeid)
    unfinished = [n for n in sidecar.get("unfinished") or [] if n not in seen]
    axes = sidecar.get("expected_axes") or {}
    for nodeid in unfinished:
        merged.append(_synthetic(run_label, nodeid, ERROR, UNFINISHED_MESSAGE, axes.get(nodeid), gating))
    done = seen | set(unfinished)
    for raw in sidecar.get("expected") or []:
        nodeid = strip_xdist_group(raw)
        if nodeid not in done and mangle(nodeid) not in reported and raw not in done:
            merged.append(_synthetic(run_label, nodeid, "not run", NOT_RUN_MESSAGE, axes.get(nodeid), gating))
            done.add(nodeid)
    if unfinished:
        run.problems.append(f"{len(unfinished)} test(s) started and never finished (crash or hang)")
    not_run = sum(c.outcome == NOT_RUN for c in merged)
    if not_run:
        run.problems.append(f"{not_run} collected test(s) never ran")
    run.cases = merged
    return run


def missing_run(label: str) -> Run:
    """A run that left neither JUnit nor a journal: one ERROR case says so."""
    case = _synthetic(label, f"{label}::<no results>", ERROR,
                      "the run produced no JUnit XML and no harness journal (it failed before pytest started "
                      "writing results, or never ran)")
    return Run(label, "(missing)", [case], complete=False, problems=["no results at all"])


def _entries(paths: Sequence[str | pathlib.Path]) -> list[tuple[pathlib.Path, str, bool]]:
    """``(base path, run label, found in a directory)`` per run named by files or directories, each once."""
    found: list[tuple[pathlib.Path, str, bool]] = []
    seen: set[pathlib.Path] = set()
    for raw in paths:
        path = pathlib.Path(raw)
        if path.is_dir():
            bases = sorted({b for f in path.rglob("*") if f.is_file() and (b := base_of(f)) is not None
                            and (f.suffix == ".xml" or f.name.endswith((SIDECAR_SUFFIX, JOURNAL_SUFFIX)))})
            if not bases:
                raise JunitError(f"no *.xml files under directory {path}")
            items = [(b, b.relative_to(path).as_posix(), True) for b in bases]
        else:
            base = base_of(path)
            sidecars = base is not None and any(base.with_name(base.name + s).exists()
                                                for s in (SIDECAR_SUFFIX, JOURNAL_SUFFIX))
            if base is None or not (path.exists() or sidecars):
                raise JunitError(f"JUnit path not found: {path}")
            items = [(base, base.name, False)]
        for base, label, scanned in items:
            if base.resolve() not in seen:
                seen.add(base.resolve())
                found.append((base, label, scanned))
    return found


def is_flaky_label(label: str) -> bool:
    """A run found under a ``flaky/`` directory of a scanned results tree (the launch scripts'
    quarantine, ``results/flaky/<gen>/<script>.xml``): reported, never gating."""
    return "flaky" in pathlib.PurePosixPath(label).parts[:-1]


def load_runs(paths: Iterable[str | pathlib.Path], missing: Iterable[str] = (),
              flaky: Iterable[str | pathlib.Path] = ()) -> list[Run]:
    """Every run named by ``paths`` (JUnit files, sidecars or directories), the non-gating runs of
    ``flaky`` (quarantined scripts) and one error run per ``missing`` label."""
    paths, missing, flaky = list(paths), list(missing), list(flaky)
    if not paths and not missing and not flaky:
        raise JunitError("no JUnit paths given")
    runs = []
    entries = [(e, True) for e in _entries(paths)] + [(e, False) for e in _entries(flaky)]
    for (base, label, scanned), may_gate in entries:
        xml_path = base.with_name(base.name + ".xml")
        xml = parse_junit_file(xml_path) if xml_path.exists() else None
        if scanned and xml is not None and xml.name == MERGED_NAME:
            continue  # an earlier sign-off's merged copy of runs that are listed on their own
        gating = may_gate and not (scanned and is_flaky_label(label))
        runs.append(build_run(label, str(xml_path), xml, read_sidecar(base), gating))
    runs.extend(missing_run(label) for label in missing)
    return runs


def merged_junit(runs: Sequence[Run]) -> PytestXml:
    """One JUnit document of every run (a suite per run) including the synthesised cases, so CI
    dashboards show a crashed run's running test as an error and its never-run tests as skipped."""
    out = PytestXml(MERGED_NAME)
    for run in runs:
        if run.xml is not None:
            for suite in run.xml:
                copied = copy.deepcopy(suite)
                copied.name = suite_run_label(suite, run.label)
                out.add_testsuite(copied)
        extra = run.synthesised if run.xml is not None else run.cases
        if extra:
            suite = junitparser.TestSuite(f"{run.label} (harness)")
            for case in extra:
                tc = junitparser.TestCase(case.name, case.classname, case.time_s)
                if case.outcome == NOT_RUN:
                    tc.result = [junitparser.Skipped(case.message, NOT_RUN_TYPE)]
                elif case.outcome == ERROR:
                    tc.result = [junitparser.Error(case.message, CRASHED_TYPE)]
                elif case.failing or case.outcome in ("skipped", "xfailed"):
                    cls = junitparser.Failure if case.failing else junitparser.Skipped
                    tc.result = [cls(case.message)]
                suite.add_testcase(tc)
            out.add_testsuite(suite)
    out.update_statistics()
    return out
