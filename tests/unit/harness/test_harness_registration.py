"""The plugin is registered exactly once, whether it comes from the entry point or the root conftest."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from harness_selftest import REPO

_CHECK = """
import sys, pytest

class Probe:
    def pytest_configure(self, config):
        mods = [p for p in config.pluginmanager.get_plugins() if getattr(p, "__name__", "") in ("harness.plugin", "harness.regression")]
        names = sorted(p.__name__ for p in mods)
        ctl = [p for p in config.pluginmanager.get_plugins() if type(p).__name__ == "Controller"]
        print("HARNESS-REGISTRATIONS", names, len(ctl))
        config.add_cleanup(lambda: None)

sys.exit(pytest.main(["--co", "-q", "-p", "no:cacheprovider", "tests/unit/harness/samples/sample_bucket20.py"], plugins=[Probe()]))
"""


@pytest.mark.parametrize("autoload", ["1", "0"], ids=["entry-points-on", "entry-points-off"])
def test_registered_once(autoload):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    if autoload == "0":
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    out = subprocess.run([sys.executable, "-c", _CHECK], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    line = next((l for l in out.stdout.splitlines() if l.startswith("HARNESS-REGISTRATIONS")), None)
    assert line is not None, out.stdout[-2000:] + out.stderr[-2000:]
    expected_modules = ["harness.plugin"] + (["harness.regression"] if (REPO / "harness" / "regression.py").exists() else [])
    assert line == f"HARNESS-REGISTRATIONS {expected_modules} 1", line
    assert "20 tests collected" in out.stdout
