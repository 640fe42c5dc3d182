"""Read pytest JUnit XML into plain records for the sign-off report.

Parsing goes through ``junitparser`` (pure Python, no dependencies), so the sign-off command runs
anywhere the XML can be copied to (a QA laptop, a CI post-step) without torch or the project
installed. Handles pytest's ``junitxml`` output (``xunit2`` by default, ``xunit1``/``legacy`` too):
a root ``<testsuites>`` (or a bare ``<testsuite>``) holding ``<testcase>`` elements with optional
``<properties>``, ``<failure>``, ``<error>`` and ``<skipped>`` children.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re
import types
from collections.abc import Iterable, Sequence

import junitparser
from junitparser.junitparser import etree as JUNIT_ETREE  # lxml when installed, else ElementTree

from harness.report.junit_format import (
    AXIS_PROPERTY_PREFIX,
    ERROR,
    FAILED,
    FLAKY,
    FLAKY_PROPERTY,
    NOT_RUN,
    NOT_RUN_TYPE,
    OUTCOMES,
    PARAM_PROPERTY_PREFIX,
    PASSED,
    RANK_PROPERTY_RE,
    RERUN_FAILURE_PROPERTY,
    SKIPPED,
    XFAILED,
)

# A testcase with several children (a failed call plus a teardown error) takes the worst outcome.
OUTCOME_RANK = types.MappingProxyType({o: i for i, o in enumerate(OUTCOMES)})
FAILING = frozenset({FAILED, ERROR})

# pytest's default suite name; any other name (``-o junit_suite_name=...``) labels the run.
DEFAULT_SUITE_NAME = "pytest"
# pytest reports a module that failed or skipped at collection as classname "" and name
# "<dirs>.<module stem>" with these messages (a skip's reason is in its text).
COLLECTION_FAILURE = "collection failure"
COLLECTION_SKIPPED = "collection skipped"

# "rank 2", "rank2", "[rank 2]", "ranks 1, 3", "rank(s) [1, 3]"
_RANK_IN_TEXT = re.compile(r"\branks?(?:\(s\))?[ _#:=-]?\s*\[?(\d+(?:\s*,\s*\d+)*)", re.IGNORECASE)
_FAIL_WORDS = re.compile(
    r"fail|error|died|crash|signal|timed? ?out|abort|exit|segfault|killed|hang", re.IGNORECASE
)


# pytest's junitxml leaves ``<testcase time="0.000"/>`` (no name, no result) for the test a
# KeyboardInterrupt (Ctrl-C, or SIGTERM where the harness turns it into one) stopped: it is not a pass.
NAMELESS_MESSAGE = ("a <testcase> without a name or a result: pytest writes one for the test that was running "
                    "when the session was interrupted (Ctrl-C, SIGTERM); its result is unknown")


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
    nodeid: str | None = None  # exact node id when known (the sidecar), else rebuilt from the classname
    wall_s: float | None = None  # a distributed test's wall time (sidecar), start-up included
    bucket: str | None = None
    ranks: tuple[tuple[int, str, float], ...] = ()  # (rank, outcome, seconds) from the sidecar
    gating: bool = True  # False for the tests of flaky scripts: reported, never gate the verdict

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
    def axes(self) -> tuple[tuple[str, str], ...]:
        """The ``axis:<name>`` properties (a functional suite's declared matrix axes), in XML order."""
        found: dict[str, str] = {}
        for name, value in self.properties:
            if name.startswith(AXIS_PROPERTY_PREFIX):
                found.setdefault(name[len(AXIS_PROPERTY_PREFIX):], value)
        return tuple(found.items())

    @property
    def seconds(self) -> float:
        """The test's cost: its wall time when the sidecar has it, else the JUnit time."""
        return self.wall_s if self.wall_s is not None else self.time_s

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
    def module_level(self) -> bool:
        """A module that failed or was skipped as a whole at collection (no test of it ran)."""
        return not self.classname and not self.nodeid and self.message in (COLLECTION_FAILURE, COLLECTION_SKIPPED)

    @property
    def test_id(self) -> str:
        """A pytest-style node id, e.g. ``tests/unit/test_x.py::TestA::test_b[p]``; a module's path
        when the whole module failed or was skipped at collection."""
        if self.nodeid:
            return self.nodeid
        module, classes = _split_classname(self)
        if self.module_level:
            return module
        return "::".join([module, *classes, self.name])

    @property
    def failing(self) -> bool:
        return self.outcome in FAILING


@dataclasses.dataclass
class Counts:
    """Outcome counts of a group of tests (a suite, a matrix cell, a run)."""

    passed: int = 0
    flaky: int = 0
    failed: int = 0
    error: int = 0
    skipped: int = 0
    xfailed: int = 0
    not_run: int = 0

    @classmethod
    def of(cls, cases: Iterable[TestCase]) -> Counts:
        counts = cls()
        for case in cases:
            attr = case.outcome.replace(" ", "_")
            setattr(counts, attr, getattr(counts, attr) + 1)
        return counts

    @property
    def total(self) -> int:
        return sum(self.values())

    @property
    def ran(self) -> int:
        """Tests that really ran to a result that is not a skip."""
        return self.passed + self.flaky + self.failed + self.error

    def values(self) -> list[int]:
        return [self.passed, self.flaky, self.failed, self.error, self.skipped, self.xfailed, self.not_run]

    def row(self) -> list[str]:
        return [str(v) for v in (self.total, *self.values())]

    def as_dict(self) -> dict[str, int]:
        return dict(zip(COUNT_HEADERS, (self.total, *self.values()), strict=True))


COUNT_HEADERS = ("tests", "passed", "flaky", "failed", "errors", "skipped", "xfailed", "not run")


def _split_classname(case: TestCase) -> tuple[str, list[str]]:
    """Split a JUnit classname into (module path, class names).

    pytest writes ``tests.unit.test_x.TestA`` for ``tests/unit/test_x.py::TestA``; the
    file attribute (xunit1) disambiguates when present, else trailing components that
    start with an upper-case letter are taken as classes (pytest's ``Test*`` default).
    """
    if case.nodeid:
        module, *rest = case.nodeid.split("::")
        return module, rest[:-1]
    parts = [p for p in case.classname.split(".") if p]
    if case.file:
        file_parts = case.file.replace("\\", "/").removesuffix(".py").split("/")
        if parts[:len(file_parts)] == file_parts:
            return case.file.replace("\\", "/"), parts[len(file_parts):]
    if case.module_level:
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
        match = RANK_PROPERTY_RE.match(name)
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


_RANK_TAG = re.compile(r"^\[[^\]]*\]\s*")  # "[rank 0] " before a distributed test's message
MAX_LIST_ITEMS = 20


def _body(line: str) -> str:
    """A traceback line without pytest's ``E`` marker column."""
    return line[1:] if line.startswith("E ") else line


def _indented_after(head: str, details: str) -> list[str]:
    """The lines indented under ``head``'s line in ``details`` (where pytest writes the rest of a
    multi-line exception message: ``E       ...damaged (1 file problem(s)):`` then ``E         a.distcp ...``)."""
    key = _RANK_TAG.sub("", head)
    lines = details.splitlines()
    for i, line in enumerate(lines):
        if line.rstrip().endswith(key):
            indent = len(_body(line)) - len(_body(line).lstrip())
            items = []
            for nxt in lines[i + 1:i + 1 + MAX_LIST_ITEMS]:
                body = _body(nxt)
                if not body.strip() or len(body) - len(body.lstrip()) <= indent:
                    break
                items.append(body.strip())
            return items
    return []


def with_listed_items(message: str, details: str) -> str:
    """``message`` on one line, with the list its first line announces (``...: `` at its end, as in
    "checkpoint X is damaged (2 file problem(s)):"): from the message's own next lines, else from the
    details, where a distributed test's one-line message leaves them. Otherwise ``message``."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines or not lines[0].endswith(":"):
        return message
    items = lines[1:MAX_LIST_ITEMS + 1] or _indented_after(lines[0], details)
    return f"{lines[0]} {'; '.join(items)}" if items else message


def one_line_cause(case: TestCase, limit: int = 160) -> str:
    """A single line saying why a test failed or was skipped, for report tables (a message that
    announces a list keeps the list: the file names of a damaged checkpoint, say)."""
    candidates = []
    if case.message == COLLECTION_SKIPPED:
        candidates.append(_collection_skip_reason(case.details))
    elif case.message and case.message != COLLECTION_FAILURE:
        candidates.append(with_listed_items(case.message, case.details))
    e_lines = [ln[1:].strip() for ln in case.details.splitlines() if ln.startswith("E ")]
    candidates.extend(e_lines[-1:])
    candidates.append(case.details)
    for text in candidates:
        for line in text.splitlines():
            line = " ".join(line.split())
            if line:
                return line if len(line) <= limit else line[:limit - 3] + "..."
    return case.message or "(no message)"


def _collection_skip_reason(details: str) -> str:
    """The reason of a module skipped at collection: pytest writes ``repr((path, line, "Skipped: why"))``."""
    try:
        value = ast.literal_eval(details.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return ""
    if isinstance(value, tuple) and value and isinstance(value[-1], str):
        return value[-1].removeprefix("Skipped: ")
    return ""


class _PytestCase(junitparser.TestCase):
    """pytest's ``<testcase>`` with the xunit1 ``file`` attribute."""

    file = junitparser.Attr()


class _PytestSuite(junitparser.TestSuite):
    testcase = _PytestCase


class PytestXml(junitparser.JUnitXml):
    """A JUnit document whose suites hold :class:`_PytestCase` elements."""

    testsuite = _PytestSuite


def case_properties(case: junitparser.TestCase) -> tuple[tuple[str, str], ...]:
    """A testcase's ``<property>`` pairs in XML order (they may repeat)."""
    props = case.child(junitparser.Properties)
    if props is None:
        return ()
    return tuple((p.name or "", p.value if p.value is not None else (p._elem.text or "")) for p in props)


def _result_kind(result: junitparser.junitparser.FinalResult) -> str:
    if isinstance(result, junitparser.Failure):
        return FAILED
    if isinstance(result, junitparser.Error):
        return ERROR
    if result.type == NOT_RUN_TYPE:
        return NOT_RUN
    return XFAILED if result.type == "pytest.xfail" else SKIPPED


def to_case(case: junitparser.TestCase, run: str) -> TestCase:
    """Turn one junitparser testcase into a TestCase (the worst of its results wins)."""
    properties = case_properties(case)
    outcome, message, details = PASSED, "", ""
    for result in case.result:
        kind = _result_kind(result)
        if OUTCOME_RANK[kind] >= OUTCOME_RANK[outcome]:
            outcome, message, details = kind, result.message or "", result.text or ""
    if outcome == PASSED and any(name == FLAKY_PROPERTY for name, _ in properties):
        outcome = FLAKY
        message = next(v for n, v in properties if n == FLAKY_PROPERTY)
        details = "\n".join(v for n, v in properties if n == RERUN_FAILURE_PROPERTY)
    try:
        time_s = float(case.time or 0.0)
    except ValueError:
        time_s = 0.0
    if not case.name and not case.classname and outcome == PASSED:
        outcome, message = ERROR, NAMELESS_MESSAGE
    return TestCase(run=run, classname=case.classname or "", name=case.name or "", outcome=outcome,
                    message=message, details=details, properties=properties, time_s=time_s,
                    file=getattr(case, "file", None))


def parse_junit_file(path: pathlib.Path) -> PytestXml:
    """The JUnit document at ``path``; JunitError names the file when it is unusable. Parsed
    with the XML library junitparser itself uses (lxml when installed), so its elements can be
    merged into documents junitparser builds."""
    try:
        tree = JUNIT_ETREE.parse(str(path))
    except FileNotFoundError:
        raise JunitError(f"JUnit file not found: {path}") from None
    except JUNIT_ETREE.ParseError as exc:
        raise JunitError(f"{path} is not well-formed XML ({exc})") from None
    except OSError as exc:
        raise JunitError(f"cannot read JUnit file {path}: {exc}") from None
    root = tree.getroot()
    if root.tag not in ("testsuites", "testsuite"):  # lxml and ElementTree alike
        raise JunitError(f"{path} is not JUnit XML: root element is <{root.tag}>, "
                         "expected <testsuites> or <testsuite>")
    xml = PytestXml.fromfile(str(path), parse_func=lambda _file: tree)
    assert isinstance(xml, PytestXml)
    return xml


def suite_run_label(suite: junitparser.TestSuite, label: str) -> str:
    """A suite's run label: its name unless it is pytest's default, else the file's label."""
    name = suite.name
    return name if name and name != DEFAULT_SUITE_NAME else label


def read_junit_file(path: pathlib.Path, label: str) -> list[TestCase]:
    """Parse one JUnit XML file; ``label`` names the run unless the suite has a name."""
    xml = parse_junit_file(path)
    return [to_case(case, suite_run_label(suite, label)) for suite in xml for case in suite]


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
