"""Merge the per-rank TestReports of one test into the controller's ordinary pytest TestReports.

A phase passes only if every rank passed, is skipped only if every rank skipped, and otherwise fails
with each failing rank's traceback and captured output labelled by rank (the first failing rank is
named as the cause). Per-rank outcomes go into ``user_properties`` (``rank0=passed`` ...), which
JUnit XML writes as properties.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from typing import Any, Literal

import pytest
from _pytest._code.code import ReprFileLocation

from harness.outcome import Fault, TestOutcome
from harness.report.junit_format import STATE_CHANGED_PROPERTY, rank_property

Phase = Literal["setup", "call", "teardown"]
Outcome = Literal["passed", "failed", "skipped"]
PHASES: tuple[Phase, ...] = ("setup", "call", "teardown")


class HarnessStateWarning(UserWarning):
    """A test left its rank changed (environment, working directory, process group); the harness
    restored it (or restarted the ranks) so the next test is unaffected."""


def state_changes(outcome: TestOutcome) -> list[str]:
    """What each rank's guard found changed after the test (``harness.rank_guard``), as ``rank r: ...``."""
    return [f"rank {r}: {c}" for r, p in sorted(outcome.payloads.items()) for c in p.get("state_changes") or []]


def needs_restart(outcome: TestOutcome) -> bool:
    """True when a rank cannot be put back in place (its default process group was destroyed or replaced)."""
    return any(p.get("restart") for p in outcome.payloads.values())


def warn_state_changes(item: pytest.Item, outcome: TestOutcome) -> None:
    """Name the test that changed its ranks' state in the warnings summary (under ``-W error`` too: the
    ``state_changed`` property of its report names it either way)."""
    changes = state_changes(outcome)
    if changes:
        try:
            warnings.warn(HarnessStateWarning(f"{item.nodeid} changed its ranks' state: " + "; ".join(changes)),
                          stacklevel=1)
        except Warning:
            pass


class RankFailureRepr:
    """A failure longrepr with a one-line ``reprcrash`` (for -r summaries and JUnit's message)."""

    def __init__(self, path: str, lineno: int, message: str, text: str) -> None:
        self.reprcrash = ReprFileLocation(path, lineno, message)
        self.text = text

    def toterminal(self, tw: Any) -> None:
        for line in self.text.splitlines():
            tw.line(line)

    def __str__(self) -> str:
        return self.text


def _rank_reports(config: pytest.Config, payload: dict[str, Any]) -> dict[str, pytest.TestReport]:
    out: dict[str, pytest.TestReport] = {}
    for data in payload.get("reports", []):
        rep = config.hook.pytest_report_from_serializable(config=config, data=data)
        if isinstance(rep, pytest.TestReport):
            out[rep.when] = rep
    return out


def _crash_line(rep: pytest.TestReport) -> str:
    crash = getattr(rep.longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return crash.message.splitlines()[0] if crash.message else ""
    text = str(rep.longrepr).strip().splitlines()
    return text[-1] if text else rep.outcome


def _state(rep: pytest.TestReport | None) -> str:
    """A rank's outcome of one phase, ``missing`` when it sent no report for it."""
    return rep.outcome if rep is not None else "missing"


def plain_label(rank: int) -> str:
    return f"rank {rank}"


def _rank_block(label: str, rank: int, rep: pytest.TestReport, cause: bool, where: str = "") -> str:
    tag = " (cause)" if cause else ""
    parts = [f"{'=' * 20} {label}{tag}: {rep.when} {rep.outcome} {'=' * 20}"] + ([where] if where else []) \
        + [rep.longreprtext]
    for title, content in rep.sections:
        parts.append(f"{'-' * 10} {title} [rank {rank}] {'-' * 10}\n{content.rstrip()}")
    return "\n".join(parts)


class ReportBuilder:
    """Builds the controller-side reports of one distributed item. ``rank_label`` names a rank in
    messages (torchrun across nodes: with its node, host and local rank); ``rank_where``, when
    given, adds a line on where a failing rank ran to its block."""

    def __init__(self, item: pytest.Item, world_size: int, outcome: TestOutcome,
                 rank_label: Callable[[int], str] = plain_label,
                 rank_where: Callable[[int], str] | None = None) -> None:
        self.item = item
        self.world_size = world_size
        self.outcome = outcome
        self.label = rank_label
        self.where = rank_where or (lambda rank: "")
        config = item.config
        self.per_rank = {r: _rank_reports(config, p) for r, p in outcome.payloads.items()}
        self.errors = {r: p["error"] for r, p in outcome.payloads.items() if p.get("error")}
        self.fail_order = [r for _, r in sorted((p.get("t", 0.0), r) for r, p in outcome.payloads.items())]
        self.path, self.lineno = str(item.location[0]), int(item.location[1] or 0)

    def rank_outcome(self, rank: int) -> str:
        if rank in self.errors:
            return "error"
        reps = self.per_rank.get(rank)
        if not reps:
            return "no-report"
        if any(r.outcome == "failed" for r in reps.values()):
            return "failed"
        if any(r.outcome == "skipped" for r in reps.values()):
            return "skipped"
        return "passed"

    def rank_state(self, rank: int) -> str:
        """The rank's outcome, ``died`` for the rank whose death ended the test."""
        fault = self.outcome.fault
        if fault is not None and fault.kind == "died" and (rank == fault.cause_rank or rank in fault.dead_ranks):
            return "died"
        return self.rank_outcome(rank)

    def rank_details(self) -> dict[str, Any]:
        """Each rank's outcome and time (its phases summed) and the test's wall time, for the JUnit sidecar."""
        ranks = {str(r): {"outcome": self.rank_state(r),
                          "duration_s": round(sum(rep.duration for rep in self.per_rank.get(r, {}).values()), 6)}
                 for r in range(self.world_size)}
        return {"wall_s": round(self.outcome.duration, 6), "ranks": ranks}

    def properties(self) -> list[tuple[str, object]]:
        props: list[tuple[str, object]] = list(self.item.user_properties)
        for r in range(self.world_size):
            props.append((rank_property(r), self.rank_state(r)))
        changes = state_changes(self.outcome)
        if changes:
            props.append((STATE_CHANGED_PROPERTY, "; ".join(changes)))
        seen: dict[tuple[str, str], list[int]] = {}
        values: dict[tuple[str, str], object] = {}
        for r in sorted(self.per_rank):
            for rep in self.per_rank[r].values():
                for name, value in rep.user_properties:
                    if (name, value) in props:
                        continue
                    k = (str(name), repr(value))
                    if r not in seen.setdefault(k, []):
                        seen[k].append(r)
                    values[k] = value
        for (name, rv), ranks in seen.items():
            if len(ranks) == self.world_size:
                props.append((name, values[(name, rv)]))
            else:
                props.extend((rank_property(r, name), values[(name, rv)]) for r in ranks)
        return props

    def _report(self, when: Phase, outcome: Outcome, longrepr: Any, sections: list[tuple[str, str]],
                 duration: float, props: list[tuple[str, object]], **extra: Any) -> pytest.TestReport:
        now = time.time()
        return pytest.TestReport(
            nodeid=self.item.nodeid, location=self.item.location, keywords={k: 1 for k in self.item.keywords},
            outcome=outcome, longrepr=longrepr, when=when, sections=sections, duration=duration,
            start=now - duration, stop=now, user_properties=props, harness_ranks=self.rank_details(), **extra)

    def build(self) -> list[pytest.TestReport]:
        props = self.properties()
        if self.outcome.fault is not None:
            return self._build_fault(self.outcome.fault, props)
        reports = []
        for when in PHASES:
            rep = self._merge_phase(when, props)
            if rep is None:
                continue
            reports.append(rep)
            if when == "setup" and rep.outcome != "passed":
                break
        if reports and reports[-1].when != "teardown":
            reports.append(self._merge_phase("teardown", props)
                           or self._report("teardown", "passed", None, [], 0.0, props))
        return reports

    def _merge_phase(self, when: Phase, props: list[tuple[str, object]]) -> pytest.TestReport | None:
        reps = {r: self.per_rank.get(r, {}).get(when) for r in range(self.world_size)}
        if all(v is None for v in reps.values()) and not self.errors:
            return None
        sections = [(f"{t} [rank {r}]", c) for r, rep in reps.items() if rep is not None for t, c in rep.sections]
        duration = max((rep.duration for rep in reps.values() if rep is not None), default=0.0)
        kinds = {(_state(rep), hasattr(rep, "wasxfail")) for rep in reps.values()}
        if len(kinds) == 1 and not self.errors and next(iter(kinds))[0] != "failed":
            base = reps[0]
            assert base is not None
            longrepr = tuple(base.longrepr) if isinstance(base.longrepr, list) else base.longrepr
            extra = {"wasxfail": base.wasxfail} if hasattr(base, "wasxfail") else {}
            return self._report(when, base.outcome, longrepr, sections, duration, props, **extra)
        return self._report(when, "failed", self._failure_repr(when, reps), sections, duration, props)

    def _failure_repr(self, when: Phase, reps: dict[int, pytest.TestReport | None]) -> RankFailureRepr:
        failing = [r for r in self.fail_order if r in self.errors or _state(reps.get(r)) == "failed"]
        others = [r for r in range(self.world_size) if r not in failing]
        status = ", ".join(f"rank {r}={_state(reps.get(r))}" for r in others)
        blocks = [f"{when} failed on rank(s) {failing}" + (f"; {status}" if status else "")] if failing else []
        first_msg = ""
        for i, r in enumerate(failing):
            if r in self.errors:
                blocks.append(f"{'=' * 20} {self.label(r)}: {self.errors[r]}")
                first_msg = first_msg or self.errors[r]
            else:
                rep = reps[r]
                assert rep is not None
                blocks.append(_rank_block(self.label(r), r, rep, cause=(i == 0 and len(failing) > 1),
                                          where=self.where(r)))
                first_msg = first_msg or f"[{self.label(r)}] {_crash_line(rep)}"
        if not failing:
            first_msg = f"ranks disagree on the {when} outcome: " + ", ".join(
                f"rank {r}={_state(reps.get(r))}" for r in range(self.world_size))
            blocks.append(first_msg)
        return RankFailureRepr(self.path, self.lineno, first_msg, "\n".join(blocks))

    def _build_fault(self, fault: Fault, props: list[tuple[str, object]]) -> list[pytest.TestReport]:
        blocks = [f"HARNESS FAULT ({fault.kind}): {fault.summary}"]
        message = fault.summary
        cause = fault.cause_rank
        if cause is not None and cause in self.per_rank:
            for when in PHASES:
                rep = self.per_rank[cause].get(when)
                if rep is not None and rep.outcome == "failed":
                    blocks.append(_rank_block(self.label(cause), cause, rep, cause=True, where=self.where(cause)))
                    message = f"[{self.label(cause)}] {_crash_line(rep)} ({fault.summary})"
                    break
        for r in self.fail_order:
            if r == cause:
                continue
            for rep in self.per_rank.get(r, {}).values():
                if rep.outcome == "failed":
                    blocks.append(_rank_block(self.label(r), r, rep, cause=False, where=self.where(r)))
        for title, text in fault.sections:
            blocks.append(f"{'-' * 10} {title} {'-' * 10}\n{text}")
        dur = self.outcome.duration
        setup = self._report("setup", "passed", None, [], 0.0, props)
        longrepr = RankFailureRepr(self.path, self.lineno, message, "\n".join(blocks))
        call = self._report("call", "failed", longrepr, [], dur, props)
        return [setup, call, self._report("teardown", "passed", None, [], 0.0, props)]
