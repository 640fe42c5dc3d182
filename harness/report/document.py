"""The sign-off as a list of neutral blocks (headings, paragraphs, tables, charts), so that the
Markdown and HTML renderers show exactly the same content in the same order.

The order (``outline.blocks``) is a release manager's: the verdict and its rules; what changed
since the baseline run and since the last release (numerics vs golden, checkpoint compatibility,
speed vs baseline: ``release_blocks``); the configuration matrix; the failures; then the rest
(known bugs and their regression tests, flaky tests, skips by reason, results per suite and file,
slowest tests and buckets, environment and, when given, mutation testing). Tables longer than
``FOLD_ROWS`` are folded (``Details``) so the sections a reader needs first stay on the first
screen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from harness.report.diff import BaselineDiff, Capped
from harness.report.junit_read import COUNT_HEADERS, Counts, TestCase, one_line_cause
from harness.report.sections import Report

MAX_LISTED = 200  # rows of one long list (skipped tests, failures, golden cells); the rest are in details.json
FOLD_ROWS = 15  # a longer table is folded behind its summary line


class Code(str):
    """A cell or item shown as code (a test id, a bug id, a path)."""


class Md(str):
    """A cell written with the report's Markdown inlines (`code`, **bold**): the HTML page renders them."""


@dataclasses.dataclass
class Heading:
    level: int
    text: str


@dataclasses.dataclass
class Para:
    text: str


@dataclasses.dataclass
class Bullets:
    items: list[str]


@dataclasses.dataclass
class Table:
    headers: list[str]
    rows: list[list[object]]


@dataclasses.dataclass
class Details:
    summary: str
    blocks: list[Any]


@dataclasses.dataclass
class Chart:
    """A picture: ``heatmap`` (the matrix), ``suite_bars`` or ``golden_plot`` (``data``: a
    ``GoldenCell``). ``fallback`` holds the same data for text: Markdown shows it in the chart's
    place (after the plot's image file, when the report is written with its assets), HTML folds it
    below."""

    kind: str
    fallback: list[Any] = dataclasses.field(default_factory=list)
    data: Any = None


Block = Heading | Para | Bullets | Table | Details | Chart


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> Table:
    return Table(list(headers), [list(r) for r in rows])


def _counts(first: str, groups: dict[str, list[TestCase]]) -> Table:
    return _table([first, *COUNT_HEADERS], ([name, *Counts.of(g).row()] for name, g in groups.items()))


def fold(summary: str, table: Table, limit: int = FOLD_ROWS) -> Block:
    """``table`` as it is when it is short, else folded behind ``summary (N rows)``."""
    return table if len(table.rows) <= limit else Details(f"{summary} ({len(table.rows)} rows)", [table])


def more_para(total: int, shown: int, what: str, details_file: str | None) -> Para:
    """The line under a capped table: how many it leaves out, and where every row is."""
    where = (f"every one is in `{details_file}`" if details_file else
             "write the report to files (`--out-dir`) for `details.json`, which lists every one")
    return Para(f"... and {total - shown:,} more {what} ({total:,} in all; the table lists the first {shown}; "
                f"{where}).")


def verdict_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, f"Verdict: {'PASS' if rep.passed else 'FAIL'}"),
                        Bullets(rep.reasons + [f"note: {n}" for n in rep.notes] or ["every rule below holds"]),
                        _table(COUNT_HEADERS, [rep.counts.row()]),
                        Heading(3, "Rules"),
                        _table(["rule", "requires", "result", "evidence"],
                               ([r.name, r.requires, "ok" if r.ok else "FAILED", Md(r.detail)] for r in rep.rules)),
                        Para(f"Generated {rep.generated} from: " + ", ".join(f"`{s}`" for s in rep.sources))]
    if len(rep.runs) > 1 or any(not r.gating for r in rep.runs):
        out += [Heading(3, "Per run"),
                fold("Every run", _table(["run", "gating", "complete", *COUNT_HEADERS],
                                         ([r.label, "yes" if r.gating else "no (flaky script)",
                                           "yes" if r.complete else "NO", *Counts.of(r.cases).row()]
                                          for r in rep.runs)))]
    return out


def suite_blocks(rep: Report) -> list[Block]:
    """Outcomes per suite (a bar each) and per test file (folded when long)."""
    return [Heading(2, "Results per suite and file"),
            Heading(3, "Per suite"), Chart("suite_bars"), _counts("suite", rep.by("suite")),
            Heading(3, "Per test file"), fold("Every test file", _counts("file", rep.by("module_path")))]


def _capped(title: str, capped: Capped, table_of: Any, foldable: bool = True) -> list[Block]:
    out: list[Block] = [Para(f"**{title}** ({capped.total})")]
    if not capped.total:
        return out + [Para("None.")]
    out.append(fold(title, table_of(capped.shown)) if foldable else table_of(capped.shown))
    if capped.hidden:
        out.append(Para(f"... and {capped.hidden} more (each list is capped at {len(capped.shown)}; "
                        "`--diff-limit` changes the cap)"))
    return out


def diff_blocks(diff: BaselineDiff | None, sources: Sequence[str]) -> list[Block]:
    out: list[Block] = [Heading(2, "Changes since baseline")]
    if diff is None:
        return out + [Para("No baseline given (`--baseline`).")]
    out.append(Para("Baseline: " + ", ".join(f"`{s}`" for s in sources)))
    if diff.empty:
        return out + [Para("No test changed its outcome; none vanished, none was added, no skip count rose.")]

    def changes(entries: list[tuple[str, str, str]]) -> Table:
        return _table(["test", "baseline", "now"], ([Code(k), o, n] for k, o, n in entries))

    def keys(entries: list[str]) -> Table:
        return _table(["test"], ([Code(k)] for k in entries))

    out += _capped("New failures", diff.new_failures, changes, foldable=False)  # the list a release stops on
    out += _capped("Fixed", diff.fixes, changes)
    out += _capped("Newly skipped or not run", diff.newly_skipped, changes)
    out += _capped("Vanished tests", diff.vanished, keys)
    out += _capped("Added tests", diff.added, keys)
    out += _capped("Other outcome changes", diff.other_changes, changes)
    out.append(Para(f"**Skip count rose** ({len(diff.skip_rise)})"))
    out.append(_table(["run", "skipped before", "skipped now"], diff.skip_rise) if diff.skip_rise else Para("No."))
    return out


def matrix_blocks(rep: Report) -> list[Block]:
    m = rep.matrix
    out: list[Block] = [Heading(2, "Configuration matrix")]
    if m.empty:
        return out + [Para("No test declares matrix axes (`@pytest.mark.matrix`); unit tests never do.")]
    counts = ", ".join(f"{n} {o}" for o, n in m.cell_counts().items())
    out.append(Para(f"Axes: {', '.join(f'`{a}`' for a in m.axes)}; columns: `{m.column_axis}`. "
                    f"{len(m.cells)} cells: {counts}. A cell shows its worst outcome and how many of its tests "
                    "had it; never-run cells are counted apart from failed ones."))
    head = [*m.row_axes, *(f"{m.column_axis}={c}" for c in m.columns)]
    cells = _table(head, ([*row, *(m.cells[(row, c)].label if (row, c) in m.cells else "" for c in m.columns)]
                          for row in m.rows))
    out.append(Chart("heatmap", fallback=[cells]))
    out.append(Heading(3, "Outcomes per axis value"))
    out.append(fold("Every axis value", _table(["axis", "value", *COUNT_HEADERS],
                                               ([a, v, *Counts.of(g).row()] for a, v, g in m.per_axis_value())),
                    limit=0))  # the heat map's data summed up: a second look, never in the way
    return out


def regression_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Known bugs and their regression tests")]
    if not rep.regressions:
        return out + [Para("No regression tests found and none required.")]
    rows = []
    for row in rep.regressions:
        c = Counts.of(row.cases)
        detail = (f"{c.passed} passed, {c.failed + c.error} failed, {c.skipped + c.xfailed} skipped"
                  + (f", {c.flaky} flaky" if c.flaky else "") + (f", {c.not_run} not run" if c.not_run else "")
                  ) if row.cases else "no test"
        tests = ", ".join(t.test_id for t in row.cases[:3]) + (" ..." if len(row.cases) > 3 else "")
        rows.append([Code(row.bug_id), row.description, "yes" if row.required else "no", detail, row.status,
                     Code(tests) if tests else "-"])
    return out + [fold("Every known bug", _table(["bug id", "description", "required", "tests", "status",
                                                  "regression tests"], rows))]


def failure_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Failures by rank")]
    if not rep.failures:
        return out + [Para("None.")]
    if rep.failures_per_rank:
        out.append(_table(["rank", "failing tests"], rep.failures_per_rank))
    out.append(_table(["test", "run", "outcome", "failing ranks", "ranks", "cause"],
                      ([Code(f.case.test_id), f.case.run, f.case.outcome, ", ".join(map(str, f.ranks)) or "-",
                        f.rank_states, f.cause] for f in rep.failures[:MAX_LISTED])))
    if len(rep.failures) > MAX_LISTED:
        out.append(more_para(len(rep.failures), MAX_LISTED, "failing tests", rep.details_file))
    return out


def flaky_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Flaky tests"),
                        Para("Reported, never gating: tests that passed only on a rerun (`--harness-reruns`) "
                             "and every test of a `flaky/` launch script.")]
    if not rep.flaky:
        return out + [Para("None.")]
    return out + [fold("Every flaky test", _table(["test", "run", "source", "outcome", "detail"],
                                                  ([Code(c.test_id), c.run, "rerun" if c.gating else "flaky script",
                                                    c.outcome, one_line_cause(c)] for c in rep.flaky)))]


def skip_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Skipped tests")]
    if not rep.skips:
        return out + [Para("None.")]
    out.append(fold("Every reason", _table(["reason", "count"], ([g.reason, len(g.cases)] for g in rep.skips))))
    listed = [c for g in rep.skips for c in g.cases]
    rows = [[Code(c.test_id), c.run, c.outcome, one_line_cause(c)] for c in listed[:MAX_LISTED]]
    blocks: list[Block] = [_table(["test", "run", "outcome", "reason"], rows)]
    if len(listed) > MAX_LISTED:
        blocks.append(Para(f"... and {len(listed) - MAX_LISTED} more"))
    return out + [Details(f"All {len(listed)} skipped tests", blocks)]


def slow_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Slowest tests and buckets"),
                        _table(["test", "run", "outcome", "seconds"],
                               ([Code(c.test_id), c.run, c.outcome, f"{c.seconds:.2f}"] for c in rep.slowest)),
                        Heading(3, "Buckets")]
    if not rep.buckets:
        return out + [Para("No bucket data (no sidecar, or no distributed test ran).")]
    return out + [_table(["bucket", "run", "ranks", "tests", "starts", "start-up s", "total s"],
                         ([Code(b["label"]), b["run"], b.get("world_size", "-"), b["tests"], b["starts"],
                           f"{b['startup_total_s']:.2f}", f"{float(b['duration_s']):.2f}"] for b in rep.buckets))]


def environment_blocks(rep: Report) -> list[Block]:
    out: list[Block] = [Heading(2, "Environment")]
    if not any(r.environment for r in rep.runs):
        return out + [Para("No sidecar (`*.harness.json`) next to the JUnit files: environment unknown.")]
    return out + [_table(["", *(r.label for r in rep.runs)], ([k, *v] for k, v in rep.environment))]


def mutant_blocks(rep: Report) -> list[Block]:
    if rep.mutants is None:
        return [Heading(2, "Mutation testing")] if rep.golden_mutants is not None else []
    muts = rep.mutants["mutants"]
    killed = sum(m.get("status") == "killed" for m in muts)
    rate = f"{100 * killed / len(muts):.0f} %" if muts else "-"
    return [Heading(2, "Mutation testing"),
            Para(f"Tier `{rep.mutants.get('tier', '?')}`: {killed} of {len(muts)} mutants killed ({rate})."),
            fold("Every mutant", _table(
                ["mutant", "bug class", "status", "killed by", "reason"],
                ([Code(m.get("name", "?")), m.get("bug_class", ""), m.get("status", "?"),
                  Code(", ".join(m.get("killed_by", [])[:3])) if m.get("killed_by") else "-", m.get("reason", "")]
                 for m in muts)))]
