"""The plugins are registered exactly once, whether they come from the entry points or the root conftest."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness_selftest import REPO

PLUGIN_MODULES = ["harness.plugin", "harness.regression_marker"]

_CHECK = f"""
import sys, pytest

class Probe:
    def pytest_configure(self, config):
        plugins = config.pluginmanager.get_plugins()
        names = sorted(p.__name__ for p in plugins if getattr(p, "__name__", "") in {PLUGIN_MODULES!r})
        ctl = [p for p in plugins if type(p).__name__ == "Controller"]
        print("HARNESS-REGISTRATIONS", names, len(ctl))

args = ["--co", "-q", "-p", "no:cacheprovider", "tests/unit/harness/samples/sample_bucket20.py"]
sys.exit(pytest.main(args, plugins=[Probe()]))
"""


@pytest.mark.parametrize("autoload", ["1", "0"], ids=["entry-points-on", "entry-points-off"])
def test_registered_once(autoload):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if autoload == "0":
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run([sys.executable, "-c", _CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("HARNESS-REGISTRATIONS")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    assert line == f"HARNESS-REGISTRATIONS {sorted(PLUGIN_MODULES)} 1", line
    assert "20 tests collected" in out.stdout
