"""Refuse pytest >= 9.2 while pytest-forked is active, at collection, before any test runs.

pytest-forked 1.7.5 marshals each forked test's report in a way pytest 9.2 no longer accepts, so
every ``@pytest.mark.forked`` test fails there, one by one, with an error that names neither
package. pyproject pins ``pytest<9.2``; this check catches an environment that broke the pin and
says so once, with the versions and the ways out.
"""
from __future__ import annotations

import re

import pytest

BROKEN_FROM = (9, 2)  # the first pytest release pytest-forked 1.7.5 fails every forked test on
FORKED_PLUGIN = "pytest_forked"  # pytest-forked's plugin name (``-p no:pytest_forked`` turns it off)


def _major_minor(version: str) -> tuple[int, int]:
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None:
        raise ValueError(f"unreadable pytest version {version!r}")
    return int(found.group(1)), int(found.group(2))


def incompatibility(pytest_version: str, forked_active: bool, forked_version: str | None) -> str | None:
    """The message to stop with, or None when this combination works."""
    if not forked_active or _major_minor(pytest_version) < BROKEN_FROM:
        return None
    return (f"pytest {pytest_version} with pytest-forked {forked_version or '(unknown version)'} active: "
            f"pytest-forked fails every @pytest.mark.forked test on pytest >= {BROKEN_FROM[0]}.{BROKEN_FROM[1]} "
            "(its report marshalling breaks), so no forked test would give a result. Install pytest<9.2 "
            "(pyproject pins it), or run without pytest-forked (-p no:pytest_forked) and isolate crash-prone tests "
            "with the harness's own process isolation (@pytest.mark.distributed(world_size=1) runs a test in "
            "a rank process of its own)")


def check(config: pytest.Config) -> None:
    """Raise ``pytest.UsageError`` when the installed pytest and an active pytest-forked clash."""
    plugin = config.pluginmanager.get_plugin(FORKED_PLUGIN)
    version = None
    if plugin is not None:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as installed
        try:
            version = installed("pytest-forked")
        except PackageNotFoundError:
            version = None
    message = incompatibility(pytest.__version__, plugin is not None, version)
    if message is not None:
        raise pytest.UsageError(message)
