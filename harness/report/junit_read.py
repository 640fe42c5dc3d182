"""Read pytest JUnit XML into plain records for the sign-off report.

Stdlib only, so the sign-off command runs anywhere the XML can be copied to (a QA
laptop, a CI post-step) without torch or the project installed. Handles pytest's
``junitxml`` output (``xunit2`` by default, ``xunit1``/``legacy`` too): a root
``<testsuites>`` (or a bare ``<testsuite>``) holding ``<testcase>`` elements with
optional ``<properties>``, ``<failure>``, ``<error>`` and ``<skipped>`` children.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import types
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Sequence

# Outcomes, worst last: a testcase with several children (a failed call plus a
# teardown error) takes the worst one.
PASSED = "passed"
XFAILED = "xfailed"
SKIPPED = "skipped"
ERROR = "error"
FAILED = "failed"
OUTCOME_RANK = types.MappingProxyType({PASSED: 0, XFAILED: 1, SKIPPED: 2, ERROR: 3, FAILED: 4})
FAILING = frozenset({FAILED, ERROR})

# pytest's default suite name; any other name (``-o junit_suite_name=...``) labels the run.
DEFAULT_SUITE_NAME = "pytest"
COLLECTION_FAILURE = "collection failure"

# Regression ids as carried in ``regression`` properties and known-bug lists: kebab-case.
BUG_ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
REGRESSION_PROPERTY = "regression"
REGRESSION_DESCRIPTION_PROPERTY = "regression_description"
PARAM_PROPERTY_PREFIX = "param:"

_RANK_PROPERTY = re.compile(r"^rank[ _-]?(\d+)(?:=(\w+))?$")
# "rank 2", "rank2", "[rank 2]", "ranks 1, 3", "rank(s) [1, 3]"
_RANK_IN_TEXT = re.compile(r"\branks?(?:\(s\))?[ _#:=-]?\s*\[?(\d+(?:\s*,\s*\d+)*)", re.IGNORECASE)
_FAIL_WORDS = re.compile(
    r"fail|error|died|crash|signal|timed? ?out|abort|exit|segfault|killed|hang", re.IGNORECASE
)


class JunitError(ValueError):
    """A JUnit input that cannot be used (missing, unreadable, not JUnit XML)."""


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One ``<testcase>``: where it came from, what happened, and its properties."""

    __test__ = False  # not a pytest test class despite the name

    run: str
    classname: str
    name: str
    outcome: str
    message: str = ""
    details: str = ""
    properties: tuple[tuple[str, str], ...] = ()
    time_s: float = 0.0
    file: str | None = None

    def prop_values(self, key: str) -> list[str]:
        """All values of property ``key`` in XML order (properties may repeat)."""
        return [value for name, value in self.properties if name == key]

    def prop(self, key: str) -> str | None:
        """The first value of property ``key``, or None."""
        values = self.prop_values(key)
        return values[0] if values else None

    @property
    def params(self) -> tuple[tuple[str, str], ...]:
        """The ``param:<name>`` properties as sorted ``(name, value)`` pairs."""
        found = {name[len(PARAM_PROPERTY_PREFIX):]: value for name, value in self.properties
                 if name.startswith(PARAM_PROPERTY_PREFIX)}
        return tuple(sorted(found.items()))

    @property
    def bracket_id(self) -> str | None:
        """The parametrisation id in ``test_x[id]``, or None if not parametrised."""
        if self.name.endswith("]") and "[" in self.name:
            return self.name[self.name.index("[") + 1:-1]
        return None

    @property
    def module_path(self) -> str:
        """The test file, e.g. ``tests/unit/test_x.py``, rebuilt from the classname."""
        return _split_classname(self)[0]

    @property
    def suite(self) -> str:
        """The top-level suite directory: ``tests/unit`` for ``tests/unit/reports/test_x.py``.

        Two path levels (``tests/<suite>``) when the file is that deep, else its directory
        (``.`` at the root); the per-file table of the report gives the detail.
        """
        parts = self.module_path.split("/")[:-1]
        return "/".join(parts[:2]) or "."

    @property
    def test_id(self) -> str:
        """A pytest-style node id, e.g. ``tests/unit/test_x.py::TestA::test_b[p]``."""
        module, classes = _split_classname(self)
        if self.message == COLLECTION_FAILURE and not classes:
            return module
        return "::".join([module, *classes, self.name])

    @property
    def failing(self) -> bool:
        return self.outcome in FAILING


def _split_classname(case: TestCase) -> tuple[str, list[str]]:
    """Split a JUnit classname into (module path, class names).

    pytest writes ``tests.unit.test_x.TestA`` for ``tests/unit/test_x.py::TestA``; the
    file attribute (xunit1) disambiguates when present, else trailing components that
    start with an upper-case letter are taken as classes (pytest's ``Test*`` default).
    """
    parts = [p for p in case.classname.split(".") if p]
    if case.file:
        file_parts = case.file.replace("\\", "/").removesuffix(".py").split("/")
        if parts[:len(file_parts)] == file_parts:
            return case.file.replace("\\", "/"), parts[len(file_parts):]
    if case.message == COLLECTION_FAILURE:
        # pytest writes a module's collection error as classname "" and name
        # "<dirs>.<module stem>".
        return "/".join([*parts, *filter(None, case.name.split("."))]) + ".py", []
    split = len(parts)
    while split > 1 and parts[split - 1][:1].isupper():
        split -= 1
    if not parts:
        return "<unknown>", []
    return "/".join(parts[:split]) + ".py", parts[split:]


def failing_ranks(case: TestCase) -> list[int]:
    """Ranks that failed, from ``rankN`` properties, else from the failure text.

    The harness records per-rank outcomes as properties (``rank2`` = ``failed``, or a
    name ``rank2=failed``) and also writes them into the failure text; older or foreign
    XML has neither, so an empty list is a normal answer.
    """
    ranks: set[int] = set()
    seen_property = False
    for name, value in case.properties:
        match = _RANK_PROPERTY.match(name)
        if match is not None:
            seen_property = True
            outcome = (match.group(2) or value).lower()
            if outcome not in (PASSED, "ok", "skipped", "pass"):
                ranks.add(int(match.group(1)))
        elif name in ("failed_ranks", "failing_ranks"):
            seen_property = True
            ranks.update(int(tok) for tok in re.findall(r"\d+", value))
    if seen_property or not case.failing:
        return sorted(ranks)
    for text in (case.message, case.details):  # the summary line first, then the body
        for line in text.splitlines():
            if _FAIL_WORDS.search(line):
                for group in _RANK_IN_TEXT.findall(line):
                    ranks.update(int(tok) for tok in re.findall(r"\d+", group))
        if ranks:
            break
    return sorted(ranks)


def one_line_cause(case: TestCase, limit: int = 160) -> str:
    """A single line saying why a test failed or was skipped, for report tables."""
    candidates = []
    if case.message and case.message != COLLECTION_FAILURE:
        candidates.append(case.message)
    e_lines = [ln[1:].strip() for ln in case.details.splitlines() if ln.startswith("E ")]
    candidates.extend(e_lines[-1:])
    candidates.append(case.details)
    for text in candidates:
        for line in text.splitlines():
            line = " ".join(line.split())
            if line:
                return line if len(line) <= limit else line[:limit - 3] + "..."
    return case.message or "(no message)"


def _parse_testcase(elem: ET.Element, run: str) -> TestCase:
    """Turn one ``<testcase>`` element into a TestCase."""
    properties = tuple(
        (prop.get("name", ""), prop.get("value", prop.text or ""))
        for props in elem.findall("properties")
        for prop in props.findall("property")
    )
    outcome, message, details = PASSED, "", ""
    for child in elem:
        if child.tag == "failure":
            kind = FAILED
        elif child.tag == "error":
            kind = ERROR
        elif child.tag == "skipped":
            kind = XFAILED if child.get("type") == "pytest.xfail" else SKIPPED
        else:
            continue
        if OUTCOME_RANK[kind] >= OUTCOME_RANK[outcome]:
            outcome = kind
            message = child.get("message", "") or ""
            details = child.text or ""
    try:
        time_s = float(elem.get("time", "0") or 0)
    except ValueError:
        time_s = 0.0
    return TestCase(
        run=run, classname=elem.get("classname", ""), name=elem.get("name", ""),
        outcome=outcome, message=message, details=details, properties=properties,
        time_s=time_s, file=elem.get("file"),
    )


def read_junit_file(path: pathlib.Path, label: str) -> list[TestCase]:
    """Parse one JUnit XML file; ``label`` names the run unless the suite has a name."""
    try:
        root = ET.parse(path).getroot()
    except FileNotFoundError:
        raise JunitError(f"JUnit file not found: {path}") from None
    except ET.ParseError as exc:
        raise JunitError(f"{path} is not well-formed XML ({exc})") from None
    except OSError as exc:
        raise JunitError(f"cannot read JUnit file {path}: {exc}") from None
    if root.tag == "testsuite":
        suites = [root]
    elif root.tag == "testsuites":
        suites = root.findall("testsuite")
    else:
        raise JunitError(
            f"{path} is not JUnit XML: root element is <{root.tag}>, "
            "expected <testsuites> or <testsuite>")
    cases: list[TestCase] = []
    for suite in suites:
        name = suite.get("name", DEFAULT_SUITE_NAME)
        run = name if name and name != DEFAULT_SUITE_NAME else label
        cases.extend(_parse_testcase(tc, run) for tc in suite.iter("testcase"))
    return cases


def find_junit_files(paths: Sequence[str | pathlib.Path]) -> list[tuple[pathlib.Path, str]]:
    """Expand files and directories into ``(xml file, run label)`` pairs, sorted.

    A file's label is its stem; a file found under a directory argument is labelled by
    its path relative to that directory (``h100/L0_unit``), so runs from several
    generations laid out as ``results/<gen>/<script>.xml`` stay apart.
    """
    found: list[tuple[pathlib.Path, str]] = []
    for raw in paths:
        path = pathlib.Path(raw)
        if path.is_dir():
            files = sorted(path.rglob("*.xml"))
            if not files:
                raise JunitError(f"no *.xml files under directory {path}")
            found.extend((f, f.relative_to(path).with_suffix("").as_posix()) for f in files)
        elif path.exists():
            found.append((path, path.stem))
        else:
            raise JunitError(f"JUnit path not found: {path}")
    return found


def read_junit(paths: Iterable[str | pathlib.Path]) -> list[TestCase]:
    """Read every JUnit file named by ``paths`` (files or directories), each file once."""
    paths = list(paths)
    if not paths:
        raise JunitError("no JUnit paths given")
    cases: list[TestCase] = []
    seen: set[pathlib.Path] = set()
    for path, label in find_junit_files(paths):
        if path.resolve() in seen:
            continue  # named twice (a directory and a file in it): count its tests once
        seen.add(path.resolve())
        cases.extend(read_junit_file(path, label))
    return cases
