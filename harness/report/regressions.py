"""Known bugs and their regression tests: the ``regression`` markers are the registry, and a list of
bug ids (``launch_scripts/known_bugs.txt``) says which must have a passing test before sign-off."""

from __future__ import annotations

import dataclasses
import pathlib
from collections import defaultdict
from collections.abc import Sequence

from harness.report.junit_format import BUG_ID_RE, REGRESSION_DESCRIPTION_PROPERTY, REGRESSION_PROPERTY
from harness.report.junit_read import (
    NOT_RUN,
    PASSED,
    SKIPPED,
    Counts,
    JunitError,
    TestCase,
)


@dataclasses.dataclass
class RegressionRow:
    """Coverage of one known bug: its tests and what they did."""

    bug_id: str
    description: str
    required: bool
    cases: list[TestCase]

    @property
    def status(self) -> str:
        """``passed`` needs at least one passing test and no failing, flaky or never-run one."""
        counts = Counts.of(self.cases)
        if not self.cases:
            return "missing"
        if counts.failed or counts.error:
            return "FAILED"
        if counts.not_run:
            return NOT_RUN
        if counts.flaky:
            return "flaky"
        if counts.passed:
            return PASSED
        return "xfailed" if counts.xfailed and not counts.skipped else SKIPPED

    @property
    def blocks_signoff(self) -> bool:
        return self.required and self.status != PASSED


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
