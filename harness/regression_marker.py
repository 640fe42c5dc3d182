"""pytest plugin (entry point ``fsdp_harness_regression``): ``@pytest.mark.regression("bug-id", description="...")``.

The markers are the registry of known bugs: there is no separate table to keep in
sync. At collection each test gets JUnit properties that the sign-off report reads:

- ``regression`` = the bug id and ``regression_description`` = its description, one
  pair per marker (a test may cover several bugs);
- ``param:<name>`` = ``str(value)`` for each parametrisation argument, so the report
  can lay out the configuration matrix by named axes.

They go into ``item.user_properties``, which pytest's junitxml writes and which the
harness core copies into the reports it builds for distributed tests.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from harness.report.junit_format import (
    BUG_ID_RE,
    PARAM_PROPERTY_PREFIX,
    REGRESSION_DESCRIPTION_PROPERTY,
    REGRESSION_PROPERTY,
)

MARKER = "regression"
_PROPERTIES_ADDED = pytest.StashKey[bool]()
MAX_PARAM_VALUE_CHARS = 200  # a long repr (a tensor, a config object) would bloat the XML
MARKER_HELP = (
    f'{MARKER}(bug_id, description=""): this test guards against the known bug `bug_id` '
    "(kebab-case, e.g. decoupled-grad-none-segfault); the sign-off report lists it and "
    "`harness-signoff --require-regressions FILE` demands that it passed."
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)


def marker_problem(mark: pytest.Mark) -> str | None:
    """Why a ``regression`` mark is malformed, or None when it is fine."""
    usage = f'use @pytest.mark.{MARKER}("bug-id", description="...")'
    if len(mark.args) != 1:
        return f"takes exactly one positional bug id, got {len(mark.args)} ({usage})"
    bug_id = mark.args[0]
    if not isinstance(bug_id, str) or not BUG_ID_RE.match(bug_id):
        return (f"bug id must be a non-empty kebab-case string (lower-case letters and "
                f"digits joined by single '-'), got {bug_id!r}")
    unknown = sorted(set(mark.kwargs) - {"description"})
    if unknown:
        return f"unknown keyword argument(s) {unknown}; allowed: description ({usage})"
    description = mark.kwargs.get("description", "")
    if not isinstance(description, str):
        return f"description must be a string, got {type(description).__name__}"
    return None


def regression_properties(item: pytest.Item) -> list[tuple[str, str]]:
    """The ``regression``/``regression_description`` pairs for an item's markers.

    Closest markers come first; a bug id marked twice (class and function) counts once.
    """
    props: list[tuple[str, str]] = []
    seen: set[str] = set()
    for mark in item.iter_markers(name=MARKER):
        if marker_problem(mark) is not None:
            continue  # reported as a collection error where the item was made
        bug_id = mark.args[0]
        if bug_id in seen:
            continue
        seen.add(bug_id)
        props.append((REGRESSION_PROPERTY, bug_id))
        props.append((REGRESSION_DESCRIPTION_PROPERTY, mark.kwargs.get("description", "")))
    return props


def _param_text(value: object) -> str:
    """A readable matrix value: ``str()``, but a class or function by its name."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return str(value)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return name if isinstance(name, str) else str(value)


def param_properties(item: pytest.Item) -> list[tuple[str, str]]:
    """``param:<name>`` properties from the item's parametrisation, in argument order."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return []
    props = []
    for name, value in callspec.params.items():
        text = _param_text(value)
        if len(text) > MAX_PARAM_VALUE_CHARS:
            text = text[:MAX_PARAM_VALUE_CHARS - 3] + "..."
        props.append((f"{PARAM_PROPERTY_PREFIX}{name}", text))
    return props


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str,
                              obj: object) -> Generator[None, object, object]:
    """Turn a malformed ``regression`` marker into a collection error of its module."""
    result = yield
    made = result if isinstance(result, list) else [result]
    for item in made:
        if not isinstance(item, pytest.Item):
            continue
        for mark in item.iter_markers(name=MARKER):
            problem = marker_problem(mark)
            if problem is not None:
                raise collector.CollectError(
                    f"{item.nodeid}: invalid @pytest.mark.{MARKER}: {problem}")
    return result


def pytest_itemcollected(item: pytest.Item) -> None:
    """Attach the regression and parameter properties that the JUnit XML carries."""
    if item.stash.get(_PROPERTIES_ADDED, False):
        return  # an item re-announced (e.g. by a plugin re-collecting) is not doubled
    item.stash[_PROPERTIES_ADDED] = True
    item.user_properties.extend(regression_properties(item) + param_properties(item))
