"""Every functional test declares its matrix axes (tests/functional/README.md), with known values."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[3]
PROBE = """
import json, sys, pytest
from harness.matrix import AXES_KEY

class Probe:
    def pytest_collection_finish(self, session):
        print("AXES-JSON", json.dumps({i.nodeid: i.stash.get(AXES_KEY, {}) for i in session.items}))

sys.exit(pytest.main(["--co", "-q", "-p", "no:cacheprovider", "tests/functional"], plugins=[Probe()]))
"""
ZERO = {"no_shard", "optim", "optim_grads", "optim_grads_params"}


def test_every_functional_test_declares_axes() -> None:
    env = dict(os.environ, HARNESS_FORCE_CPU="1")
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("AXES-JSON ")), None)
    assert line is not None and out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    axes = json.loads(line.removeprefix("AXES-JSON "))
    assert len(axes) > 100
    assert [n for n, a in axes.items() if not a] == []
    assert [n for n, a in axes.items() if "zero" in a and a["zero"] not in ZERO] == []
    assert {a["outer"] for a in axes.values() if "outer" in a} <= {"no_shard", "optim"}
    assert all(a["mesh"].startswith(("shard", "outer")) for a in axes.values() if "mesh" in a)
