"""Root conftest: register the harness plugins in a source checkout that is not pip-installed.

When the package is installed, pytest already loaded the ``pytest11`` entry points
(``fsdp_harness`` -> harness.plugin, ``fsdp_harness_regression`` -> harness.regression_marker); registering
the same modules again would run every hook twice, so each is registered only if it is not yet there.
"""
from __future__ import annotations

import importlib.util
import sys

_PLUGINS = (("fsdp_harness", "harness.plugin"), ("fsdp_harness_regression", "harness.regression_marker"))


def pytest_addhooks(pluginmanager) -> None:  # type: ignore[no-untyped-def]
    for entry_name, module_name in _PLUGINS:
        if pluginmanager.get_plugin(entry_name) is not None or pluginmanager.get_plugin(module_name) is not None:
            continue
        if pluginmanager.is_blocked(entry_name) or pluginmanager.is_blocked(module_name):
            continue
        module = sys.modules.get(module_name)
        if module is not None and pluginmanager.is_registered(module):
            continue
        if importlib.util.find_spec(module_name) is None:
            continue
        pluginmanager.import_plugin(module_name)
