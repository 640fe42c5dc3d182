"""The configuration matrix: the functional suites' declared axes (``axis:<name>`` properties) laid
out as rows x columns of cells, each cell holding the tests of one combination of axis values.

Only tests that declare axes appear (unit tests never do). The column axis is ``zero`` when present
(few values, the axis every suite varies), else the axis with the fewest values; every other axis
forms the rows. A cell's outcome is the worst of its tests, where a cell whose tests never ran is
``not run``, counted apart from failures.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from collections.abc import Sequence

from harness.report.junit_read import (
    ERROR,
    FAILED,
    FLAKY,
    NOT_RUN,
    PASSED,
    SKIPPED,
    XFAILED,
    TestCase,
)

PREFERRED_COLUMN = "zero"
ABSENT = "-"  # a test that does not declare an axis another test of the matrix declares
CELL_ORDER = (FAILED, ERROR, NOT_RUN, FLAKY, PASSED, XFAILED, SKIPPED)  # first one present colours the cell


def natural(text: str) -> list[tuple[int, int, str]]:
    """Sort key that puts ``2`` before ``10`` (world sizes, mesh shapes)."""
    return [(0, int(tok), "") if tok.isdigit() else (1, 0, tok) for tok in re.split(r"(\d+)", text) if tok]


@dataclasses.dataclass
class Cell:
    """The tests of one combination of axis values."""

    cases: list[TestCase]

    @property
    def outcome(self) -> str:
        present = {c.outcome for c in self.cases}
        return next(o for o in CELL_ORDER if o in present)

    @property
    def label(self) -> str:
        """Short text: ``PASS 3``, ``FAIL 1/3``, ``NOT RUN 2``."""
        n = len(self.cases)
        hits = sum(c.outcome == self.outcome for c in self.cases)
        word = {PASSED: "pass", SKIPPED: "skip", XFAILED: "xfail"}.get(self.outcome, self.outcome.upper())
        return f"{word} {hits}/{n}" if hits != n else f"{word} {n}"


@dataclasses.dataclass
class MatrixView:
    """Rows (tuples of row-axis values) by columns (values of the column axis)."""

    axes: list[str]
    column_axis: str | None
    row_axes: list[str]
    rows: list[tuple[str, ...]]
    columns: list[str]
    cells: dict[tuple[tuple[str, ...], str], Cell]

    @property
    def empty(self) -> bool:
        return not self.cells

    def cell_counts(self) -> dict[str, int]:
        """How many cells have each outcome (never-run cells apart from failed ones)."""
        counts = Counter(cell.outcome for cell in self.cells.values())
        return {o: counts[o] for o in CELL_ORDER if counts[o]}

    def per_axis_value(self) -> list[tuple[str, str, list[TestCase]]]:
        """``(axis, value, tests)`` for every value of every axis."""
        out: list[tuple[str, str, list[TestCase]]] = []
        for i, axis in enumerate(self.axes):
            groups: dict[str, list[TestCase]] = {}
            for (row, col), cell in self.cells.items():
                values = self._values(row, col)
                groups.setdefault(values[i], []).extend(cell.cases)
            out.extend((axis, v, groups[v]) for v in sorted(groups, key=natural))
        return out

    def _values(self, row: tuple[str, ...], col: str) -> list[str]:
        by_axis = dict(zip(self.row_axes, row, strict=True))
        if self.column_axis is not None:
            by_axis[self.column_axis] = col
        return [by_axis[a] for a in self.axes]


def axis_order(cases: Sequence[TestCase], declared: Sequence[str]) -> list[str]:
    """The declared axes (in declared order) that some test uses, then any others alphabetically."""
    used = {name for c in cases for name, _ in c.axes}
    return [a for a in declared if a in used] + sorted(used - set(declared))


def build(cases: Sequence[TestCase], declared: Sequence[str] = ()) -> MatrixView:
    """Lay out the tests that declare axes; ``declared`` gives the axis order (the ini option)."""
    with_axes = [c for c in cases if c.axes]
    axes = axis_order(with_axes, declared)
    values = {a: sorted({dict(c.axes).get(a, ABSENT) for c in with_axes}, key=natural) for a in axes}
    column: str | None = None
    if PREFERRED_COLUMN in axes:
        column = PREFERRED_COLUMN
    elif axes:
        column = min(axes, key=lambda a: (len(values[a]) < 2, len(values[a]), axes.index(a)))
    row_axes = [a for a in axes if a != column]
    cells: dict[tuple[tuple[str, ...], str], Cell] = {}
    for case in with_axes:
        got = dict(case.axes)
        row = tuple(got.get(a, ABSENT) for a in row_axes)
        col = got.get(column, ABSENT) if column is not None else "all"
        cells.setdefault((row, col), Cell([])).cases.append(case)
    rows = sorted({r for r, _ in cells}, key=lambda r: [natural(v) for v in r])
    columns = values[column] if column is not None else ["all"]
    return MatrixView(axes, column, row_axes, rows, columns, cells)
