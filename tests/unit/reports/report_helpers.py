"""Helpers shared by the sign-off tests: run the command in-process, read its Markdown tables."""

from __future__ import annotations

import pytest

from harness.report import signoff


def table_rows(report: str, heading: str, first_header: str | None = None) -> list[dict[str, str]]:
    """Rows of the first Markdown table after ``heading`` (whose first header is ``first_header``,
    when given), as dicts keyed by header."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == heading)
    table: list[str] = []
    for line in lines[start + 1:]:
        if line.startswith("|") and (table or first_header is None or line.startswith(f"| {first_header} |")):
            table.append(line)
        elif table:
            break
    split = [[c.strip() for c in row.strip("|").split(" | ")] for row in table]
    headers = split[0]
    return [dict(zip(headers, row, strict=True)) for row in split[2:]]


def section(report: str, heading: str) -> str:
    """The text of one ``## `` section (up to the next one)."""
    return report.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def run_main(args: list[object], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = signoff.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err
