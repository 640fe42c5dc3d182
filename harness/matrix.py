"""The ``matrix`` marker: a suite names the configuration axes each of its tests covers.

A sign-off matrix is only as good as its axes, so the suites declare them instead of the report
guessing from parameter names::

    pytestmark = pytest.mark.matrix(mesh="dp_shard4", dtype="fp32")

    @pytest.mark.matrix(zero=matrix.param("strategy"), model=matrix.param("name"))
    @pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
    @pytest.mark.parametrize("name", ["cnn", "transformer"])
    def test_parity(strategy, name, dist_env): ...

Each keyword is an axis. Its value is a literal (``str``/``int``/``float``/``bool``; ``None`` leaves
the axis out), :func:`param` (the value of one parametrisation argument, optionally mapped through a
function), or a callable that receives the test's parametrisation as a dict. Marks on a module, a
class, a test and a ``pytest.param`` merge; the closest mark wins per axis. The ini option
``harness_matrix_axes`` lists the allowed axis names in report order (empty: any name).

The resolved axes become JUnit properties ``axis:<name>`` and are stored under :data:`AXES_KEY`.
Tests without a ``matrix`` mark (unit tests) have no axes and never appear in the matrix.
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Generator, Mapping
from typing import Any

import pytest

from harness.report.junit_format import AXIS_PROPERTY_PREFIX

MARKER = "matrix"
INI_AXES = "harness_matrix_axes"
MAX_VALUE_CHARS = 100
AXES_KEY = pytest.StashKey[dict[str, str]]()
MARKER_HELP = (f"{MARKER}(axis=value, ...): the configuration-matrix axes this test covers; a value is a "
               "literal, harness.matrix.param('argname', fmt=None) or a callable of the parametrisation "
               f"dict; allowed axis names: ini {INI_AXES}")
_AXIS_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class MatrixUsageError(Exception):
    """A malformed ``matrix`` mark; the message names the test, the axis and what is allowed."""


@dataclasses.dataclass(frozen=True)
class FromParam:
    """The axis takes the value of parametrisation argument ``name``, mapped through ``fmt`` if given."""

    name: str
    fmt: Callable[[Any], object] | None = None


def param(name: str, fmt: Callable[[Any], object] | None = None) -> FromParam:
    """``matrix(zero=param("strategy"))``: the axis value is that argument's value (through ``fmt``)."""
    return FromParam(name, fmt)


def value_text(value: object) -> str:
    """How an axis value is written: ``str()``, but a class or function by its name."""
    if isinstance(value, (str, int, float, bool)):
        return str(value)
    name = getattr(value, "__qualname__", None) or getattr(value, "__name__", None)
    return name if isinstance(name, str) else str(value)


def _resolve(nodeid: str, axis: str, spec: object, params: Mapping[str, Any]) -> str | None:
    if isinstance(spec, FromParam):
        if spec.name not in params:
            raise MatrixUsageError(
                f"{nodeid}: matrix({axis}=param({spec.name!r})): the test has no parametrisation argument "
                f"{spec.name!r} (it has: {sorted(params) or 'none'})")
        value = params[spec.name]
        value = spec.fmt(value) if spec.fmt is not None else value
    elif callable(spec) and not isinstance(spec, type):
        try:
            value = spec(dict(params))
        except Exception as exc:
            raise MatrixUsageError(f"{nodeid}: matrix({axis}=<callable>) raised {exc!r}") from None
    else:
        value = spec
    if value is None:
        return None
    text = value_text(value)
    if not text or len(text) > MAX_VALUE_CHARS:
        raise MatrixUsageError(f"{nodeid}: matrix axis {axis!r} value {text[:40]!r}... must be 1 to "
                               f"{MAX_VALUE_CHARS} characters")
    return text


def allowed_axes(config: pytest.Config) -> list[str]:
    """Axis names from the ini option, in report order (empty: any name is allowed)."""
    return [a for a in config.getini(INI_AXES) if a]


def item_axes(item: pytest.Item, allowed: list[str]) -> dict[str, str]:
    """Resolve every ``matrix`` mark of ``item`` (closest first) into ``{axis: value text}``."""
    params = dict(getattr(getattr(item, "callspec", None), "params", {}))
    specs: dict[str, object] = {}
    for mark in item.iter_markers(MARKER):
        if mark.args:
            raise MatrixUsageError(f"{item.nodeid}: matrix() takes keyword arguments only (axis=value), "
                                   f"got positional {mark.args!r}")
        for axis, spec in mark.kwargs.items():
            if not _AXIS_NAME.match(axis):
                raise MatrixUsageError(f"{item.nodeid}: matrix axis name {axis!r} must be lower_snake_case")
            if allowed and axis not in allowed:
                raise MatrixUsageError(f"{item.nodeid}: unknown matrix axis {axis!r}; allowed ({INI_AXES}): "
                                       f"{allowed}")
            specs.setdefault(axis, spec)
    axes = {}
    for axis, spec in specs.items():
        text = _resolve(item.nodeid, axis, spec, params)
        if text is not None:
            axes[axis] = text
    order = {a: i for i, a in enumerate(allowed)}
    return dict(sorted(axes.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(INI_AXES, "allowed matrix axis names, in the order the sign-off report shows them",
                  type="args", default=[])


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)


@pytest.hookimpl(wrapper=True)
def pytest_pycollect_makeitem(collector: pytest.Collector, name: str, obj: object) -> Generator[None, Any, Any]:
    """Resolve the axes as items are made, so a bad mark is a collection error of its module."""
    result = yield
    made = result if isinstance(result, list) else [result]
    allowed = allowed_axes(collector.config)
    for item in made:
        if not isinstance(item, pytest.Item) or AXES_KEY in item.stash:
            continue
        try:
            axes = item_axes(item, allowed)
        except MatrixUsageError as exc:
            raise collector.CollectError(f"fsdp_harness: {exc}") from None
        item.stash[AXES_KEY] = axes
        item.user_properties.extend((AXIS_PROPERTY_PREFIX + axis, value) for axis, value in axes.items())
    return result
