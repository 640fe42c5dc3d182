"""``harness-signoff``: turn JUnit XML from one or more runs into a QA sign-off report.

QA signs a release off from one Markdown page: the configuration matrix that was
tested, pass/fail/skip per suite and per matrix cell, every skip with its reason,
every failure with its failing ranks and a one-line cause, which known bugs have a
regression test and whether it passed, what changed since a baseline run, and a
PASS/FAIL verdict. Exit codes: 0 PASS, 1 FAIL, 2 unusable input. Stdlib only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import pathlib
import re
import sys
from collections import defaultdict
from collections.abc import Iterable, Sequence

from harness.report.junit_read import (
    BUG_ID_RE,
    ERROR,
    FAILED,
    OUTCOME_RANK,
    PASSED,
    REGRESSION_DESCRIPTION_PROPERTY,
    REGRESSION_PROPERTY,
    SKIPPED,
    XFAILED,
    JunitError,
    TestCase,
    failing_ranks,
    one_line_cause,
    read_junit,
)

EXIT_PASS, EXIT_FAIL, EXIT_BAD_INPUT = 0, 1, 2
DEFAULT_TITLE = "QA sign-off report"
NOT_PARAMETRISED = "(not parametrised)"
UNNAMED_ID = "[id]"  # matrix axis for parametrised tests without param:* properties


@dataclasses.dataclass
class Counts:
    """Outcome counts of a group of tests (a suite, a matrix cell, a run)."""

    passed: int = 0
    failed: int = 0
    error: int = 0
    skipped: int = 0
    xfailed: int = 0

    @classmethod
    def of(cls, cases: Iterable[TestCase]) -> Counts:
        counts = cls()
        for case in cases:
            setattr(counts, case.outcome, getattr(counts, case.outcome) + 1)
        return counts

    @property
    def total(self) -> int:
        return self.passed + self.failed + self.error + self.skipped + self.xfailed

    def row(self) -> list[str]:
        return [str(v) for v in (self.total, self.passed, self.failed, self.error,
                                 self.skipped, self.xfailed)]


COUNT_HEADERS = ("tests", "passed", "failed", "errors", "skipped", "xfailed")


@dataclasses.dataclass
class RegressionRow:
    """Coverage of one known bug: its tests and what they did."""

    bug_id: str
    description: str
    required: bool
    cases: list[TestCase]

    @property
    def status(self) -> str:
        """``passed`` needs at least one passing test and no failing one."""
        counts = Counts.of(self.cases)
        if not self.cases:
            return "missing"
        if counts.failed or counts.error:
            return "FAILED"
        if counts.passed:
            return PASSED
        return "xfailed" if counts.xfailed and not counts.skipped else SKIPPED

    @property
    def blocks_signoff(self) -> bool:
        return self.required and self.status != PASSED


@dataclasses.dataclass
class BaselineDiff:
    """Test-level changes between a baseline run and the current one."""

    newly_failing: list[tuple[str, str, str]]  # (test key, baseline outcome, now)
    newly_passing: list[tuple[str, str, str]]
    other_changes: list[tuple[str, str, str]]
    added: list[str]
    removed: list[str]


def _esc(text: str) -> str:
    """Make text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _table(headers: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines.extend("| " + " | ".join(_esc(c) for c in row) + " |" for row in rows)
    return lines


def parse_required_regressions(path: pathlib.Path) -> dict[str, str]:
    """Read a list of bug ids that must have a passing regression test.

    Text format: one ``bug-id [description]`` per line, ``#`` starts a comment. A
    ``.toml`` file holds ``regressions = ["id", ...]`` or a list of ``{id, description}``.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise JunitError(f"cannot read --require-regressions file {path}: {exc}") from None
    entries: list[tuple[str, str, str]] = []  # (id, description, where)
    if path.suffix == ".toml":
        entries = _parse_required_toml(path, text)
    else:
        for lineno, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if line:
                bug_id, _, description = line.partition(" ")
                entries.append((bug_id.rstrip(":"), description.strip(), f"{path}:{lineno}"))
    required: dict[str, str] = {}
    for bug_id, description, where in entries:
        if not BUG_ID_RE.match(bug_id):
            raise JunitError(f"{where}: bug id {bug_id!r} is not kebab-case "
                             "(lower-case letters and digits joined by single '-')")
        required[bug_id] = description
    return required


def _parse_required_toml(path: pathlib.Path, text: str) -> list[tuple[str, str, str]]:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        raise JunitError(f"{path}: reading TOML needs Python 3.11+; use the text format") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise JunitError(f"{path} is not valid TOML ({exc})") from None
    items = data.get("regressions")
    if not isinstance(items, list):
        raise JunitError(f"{path}: expected a top-level list 'regressions = [...]'")
    entries = []
    for index, item in enumerate(items):
        where = f"{path}: regressions[{index}]"
        if isinstance(item, str):
            entries.append((item, "", where))
        elif isinstance(item, dict) and isinstance(item.get("id"), str):
            entries.append((item["id"], str(item.get("description", "")), where))
        else:
            raise JunitError(f"{where} must be a string or a table with an 'id' string")
    return entries


def regression_rows(cases: Sequence[TestCase], required: dict[str, str]) -> list[RegressionRow]:
    """One row per bug id seen in ``regression`` properties or listed as required."""
    by_bug: dict[str, list[TestCase]] = defaultdict(list)
    descriptions: dict[str, str] = {}
    for case in cases:
        current = None  # a description belongs to the regression id just before it
        seen: set[str] = set()
        for name, value in case.properties:
            if name == REGRESSION_PROPERTY:
                current = value
                if value not in seen:
                    seen.add(value)
                    by_bug[value].append(case)
            elif name == REGRESSION_DESCRIPTION_PROPERTY and current and value:
                descriptions.setdefault(current, value)
    ids = sorted(set(by_bug) | set(required))
    return [RegressionRow(bug_id, required.get(bug_id) or descriptions.get(bug_id, ""),
                          bug_id in required, by_bug.get(bug_id, [])) for bug_id in ids]


def _keyed(cases: Sequence[TestCase], with_run: bool) -> dict[str, str]:
    """Map test key to its worst outcome (duplicates such as reruns keep the worst)."""
    keyed: dict[str, str] = {}
    for case in cases:
        key = f"{case.run} :: {case.test_id}" if with_run else case.test_id
        old = keyed.get(key)
        if old is None or OUTCOME_RANK[case.outcome] > OUTCOME_RANK[old]:
            keyed[key] = case.outcome
    return keyed


def baseline_diff(current: Sequence[TestCase], baseline: Sequence[TestCase]) -> BaselineDiff:
    """Compare outcomes per test.

    Tests are matched by run label and test id when both sides hold the same set of
    run labels (e.g. ``h100/L0_unit``), else by test id alone, so ``--junit new.xml
    --baseline old.xml`` compares the same tests although the file names differ.
    """
    with_run = {c.run for c in current} == {c.run for c in baseline}
    now, before = _keyed(current, with_run), _keyed(baseline, with_run)
    diff = BaselineDiff([], [], [], sorted(set(now) - set(before)),
                        sorted(set(before) - set(now)))
    for key in sorted(set(now) & set(before)):
        old, new = before[key], now[key]
        if old == new:
            continue
        entry = (key, old, new)
        if new in (FAILED, ERROR) and old not in (FAILED, ERROR):
            diff.newly_failing.append(entry)
        elif new == PASSED and old in (FAILED, ERROR):
            diff.newly_passing.append(entry)
        else:
            diff.other_changes.append(entry)
    return diff


def verdict(cases: Sequence[TestCase], rows: Sequence[RegressionRow]) -> tuple[bool, list[str]]:
    """PASS unless a test failed or errored, a required regression is not passing, or
    there were no results at all; the reasons say which."""
    counts = Counts.of(cases)
    reasons = []
    if not cases:
        reasons.append("no test results in the JUnit input")
    if counts.failed:
        reasons.append(f"{counts.failed} test(s) failed")
    if counts.error:
        reasons.append(f"{counts.error} test(s) errored")
    for row in rows:
        if row.blocks_signoff:
            reasons.append(f"required regression `{row.bug_id}` is {row.status}")
    return not reasons, reasons


def _cell_key(case: TestCase, with_run: bool) -> str:
    parts = [f"{name}={value}" for name, value in case.params]
    if not parts and case.bracket_id is not None:
        parts = [f"{UNNAMED_ID}={case.bracket_id}"]
    cell = ", ".join(parts) or NOT_PARAMETRISED
    return f"{case.run}: {cell}" if with_run else cell


def _natural(text: str) -> list[tuple[int, int, str]]:
    """Sort key that puts ``2`` before ``10`` (world sizes, batch sizes)."""
    return [(0, int(tok), "") if tok.isdigit() else (1, 0, tok)
            for tok in re.split(r"(\d+)", text) if tok]


def _matrix_section(cases: Sequence[TestCase]) -> list[str]:
    axes: dict[str, dict[str, list[TestCase]]] = defaultdict(lambda: defaultdict(list))
    for case in cases:
        for name, value in case.params:
            axes[name][value].append(case)
        if not case.params and case.bracket_id is not None:
            axes[UNNAMED_ID][case.bracket_id].append(case)
    runs = sorted({c.run for c in cases})
    lines = ["## Configuration matrix", ""]
    if len(runs) > 1:
        lines += [f"Runs: {', '.join(f'`{r}`' for r in runs)}", ""]
    if not axes:
        lines.append("No parametrised tests.")
    else:
        lines += _table(["parameter", "values"],
                        ([name, ", ".join(sorted(vals, key=_natural))]
                         for name, vals in sorted(axes.items())))
        lines += ["", "### Outcomes per parameter value", ""]
        lines += _table(["parameter", "value", *COUNT_HEADERS],
                        ([name, value, *Counts.of(group).row()]
                         for name, vals in sorted(axes.items())
                         for value, group in sorted(vals.items(), key=lambda kv: _natural(kv[0]))))
    cells: dict[str, list[TestCase]] = defaultdict(list)
    for case in cases:
        cells[_cell_key(case, len(runs) > 1)].append(case)
    lines += ["", "### Outcomes per matrix cell", ""]
    lines += _table(["cell", *COUNT_HEADERS],
                    ([cell, *Counts.of(group).row()]
                     for cell, group in sorted(cells.items(), key=lambda kv: _natural(kv[0]))))
    return lines + [""]


def _suite_section(cases: Sequence[TestCase]) -> list[str]:
    by_suite: dict[str, list[TestCase]] = defaultdict(list)
    by_file: dict[str, list[TestCase]] = defaultdict(list)
    for case in cases:
        by_suite[case.suite].append(case)
        by_file[case.module_path].append(case)
    lines = ["## Results per suite", ""]
    lines += _table(["suite", *COUNT_HEADERS],
                    ([s, *Counts.of(g).row()] for s, g in sorted(by_suite.items())))
    lines += ["", "### Per test file", ""]
    lines += _table(["file", *COUNT_HEADERS],
                    ([f, *Counts.of(g).row()] for f, g in sorted(by_file.items())))
    return lines + [""]


def _regression_section(rows: Sequence[RegressionRow]) -> list[str]:
    lines = ["## Known bugs and their regression tests", ""]
    if not rows:
        return lines + ["No regression tests found and none required.", ""]
    table = []
    for row in rows:
        counts = Counts.of(row.cases)
        detail = (f"{counts.passed} passed, {counts.failed + counts.error} failed, "
                  f"{counts.skipped + counts.xfailed} skipped") if row.cases else "no test"
        table.append([f"`{row.bug_id}`", row.description, "yes" if row.required else "no",
                      detail, row.status])
    lines += _table(["bug id", "description", "required", "tests", "status"], table)
    return lines + [""]


def _failure_section(cases: Sequence[TestCase]) -> list[str]:
    failing = [c for c in cases if c.failing]
    lines = ["## Failures", ""]
    if not failing:
        return lines + ["None.", ""]
    rows = []
    for case in sorted(failing, key=lambda c: (c.run, c.test_id)):
        ranks = failing_ranks(case)
        rows.append([f"`{case.test_id}`", case.run, case.outcome,
                     ", ".join(map(str, ranks)) if ranks else "-", one_line_cause(case)])
    return lines + _table(["test", "run", "outcome", "failing ranks", "cause"], rows) + [""]


def _skip_section(cases: Sequence[TestCase]) -> list[str]:
    skipped = [c for c in cases if c.outcome in (SKIPPED, XFAILED)]
    lines = ["## Skipped tests", ""]
    if not skipped:
        return lines + ["None.", ""]
    by_reason: dict[str, int] = defaultdict(int)
    for case in skipped:
        by_reason[f"{case.outcome}: {one_line_cause(case)}"] += 1
    lines += _table(["reason", "count"],
                    ([r, str(n)] for r, n in sorted(by_reason.items(), key=lambda kv: -kv[1])))
    lines += ["", f"<details><summary>All {len(skipped)} skipped tests</summary>", ""]
    lines += _table(["test", "run", "outcome", "reason"],
                    ([f"`{c.test_id}`", c.run, c.outcome, one_line_cause(c)]
                     for c in sorted(skipped, key=lambda c: (c.run, c.test_id))))
    return lines + ["", "</details>", ""]


def _baseline_section(diff: BaselineDiff | None, sources: Sequence[str]) -> list[str]:
    lines = ["## Changes since baseline", ""]
    if diff is None:
        return lines + ["No baseline given (`--baseline`).", ""]
    lines += [f"Baseline: {', '.join(f'`{s}`' for s in sources)}", ""]
    groups = [("Newly failing", diff.newly_failing), ("Newly passing", diff.newly_passing),
              ("Other outcome changes", diff.other_changes)]
    for title, entries in groups:
        lines.append(f"**{title}** ({len(entries)})")
        lines += [""] + (_table(["test", "baseline", "now"], ([f"`{k}`", o, n] for k, o, n in entries))
                         if entries else ["None."]) + [""]
    for title, keys in (("Added tests", diff.added), ("Removed tests", diff.removed)):
        lines += [f"**{title}** ({len(keys)})", ""]
        lines += [f"- `{k}`" for k in keys] if keys else ["None."]
        lines.append("")
    return lines


def render_report(title: str, cases: Sequence[TestCase], rows: Sequence[RegressionRow],
                  diff: BaselineDiff | None, sources: Sequence[str],
                  baseline_sources: Sequence[str] = ()) -> tuple[str, bool]:
    """Build the Markdown report; returns (text, passed)."""
    passed, reasons = verdict(cases, rows)
    total = Counts.of(cases)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# {title}", "", f"## Verdict: {'PASS' if passed else 'FAIL'}", ""]
    lines += [f"- {r}" for r in reasons] or ["- every test passed or was skipped with a reason; "
                                             "every required regression test passed"]
    lines += ["", f"Generated {stamp} from: {', '.join(f'`{s}`' for s in sources)}", ""]
    lines += _table(COUNT_HEADERS, [total.row()]) + [""]
    by_run: dict[str, list[TestCase]] = defaultdict(list)
    for case in cases:
        by_run[case.run].append(case)
    if len(by_run) > 1:
        lines += ["### Per run", ""]
        lines += _table(["run", *COUNT_HEADERS],
                        ([r, *Counts.of(g).row()] for r, g in sorted(by_run.items()))) + [""]
    lines += _suite_section(cases) + _matrix_section(cases) + _regression_section(rows)
    lines += _failure_section(cases) + _skip_section(cases) + _baseline_section(diff, baseline_sources)
    return "\n".join(lines), passed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="harness-signoff",
        description="Turn JUnit XML from one or more test runs into a Markdown QA sign-off "
                    "report with a PASS/FAIL verdict.",
        epilog="Exit status: 0 PASS, 1 FAIL, 2 bad input.")
    parser.add_argument("--junit", action="append", required=True, metavar="PATH",
                        help="JUnit XML file or directory of them (repeatable)")
    parser.add_argument("--baseline", nargs="+", action="extend", metavar="PATH",
                        help="JUnit XML files/directories of the baseline run")
    parser.add_argument("--require-regressions", type=pathlib.Path, metavar="FILE",
                        help="list of bug ids that must have a passing regression test")
    parser.add_argument("--output", type=pathlib.Path, metavar="FILE",
                        help="write the Markdown report here (default: stdout)")
    parser.add_argument("--title", default=DEFAULT_TITLE, help="report title")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        cases = read_junit(args.junit)
        baseline = read_junit(args.baseline) if args.baseline else None
        required = (parse_required_regressions(args.require_regressions)
                    if args.require_regressions else {})
    except JunitError as exc:
        print(f"harness-signoff: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    rows = regression_rows(cases, required)
    diff = baseline_diff(cases, baseline) if baseline is not None else None
    text, passed = render_report(args.title, cases, rows, diff, args.junit, args.baseline or ())
    if args.output is not None:
        try:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"harness-signoff: error: cannot write --output {args.output}: {exc}",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"harness-signoff: {'PASS' if passed else 'FAIL'} "
              f"({len(cases)} tests) -> {args.output}")
    else:
        sys.stdout.write(text + "\n")
    return EXIT_PASS if passed else EXIT_FAIL


if __name__ == "__main__":
    sys.exit(main())
