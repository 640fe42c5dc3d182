"""What the functional suites declare for the sign-off: every test its matrix axes
(tests/functional/README.md), and every suite at least one L0 cell that exists, is not slow and is
skipped only for a missing requirement (tests/functional/conftest.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
PROBE = """
import json, sys, pytest
from harness.matrix import AXES_KEY

class Probe:
    def pytest_collection_finish(self, session):
        print("ITEMS-JSON", json.dumps({i.nodeid: {"axes": i.stash.get(AXES_KEY, {}),
                                                  "marks": sorted({m.name for m in i.iter_markers()})}
                                       for i in session.items}))

sys.exit(pytest.main(["--co", "-q", "-p", "no:cacheprovider", "tests/functional"], plugins=[Probe()]))
"""
ZERO = {"no_shard", "optim", "optim_grads", "optim_grads_params"}


@pytest.fixture(scope="module")
def items() -> dict[str, dict]:
    """Every functional test's axes and marker names, from one collection in a subprocess."""
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=dict(os.environ, HARNESS_FORCE_CPU="1"),
                         capture_output=True, text=True, timeout=600)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ITEMS-JSON ")), None)
    assert line is not None and out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return json.loads(line.removeprefix("ITEMS-JSON "))


def test_every_functional_test_declares_axes(items) -> None:
    assert len(items) > 100
    assert [n for n, i in items.items() if not i["axes"]] == []
    axes = [i["axes"] for i in items.values()]
    assert [a for a in axes if "zero" in a and a["zero"] not in ZERO] == []
    assert {a["outer"] for a in axes if "outer" in a} <= {"no_shard", "optim"}
    assert all(a["mesh"].startswith(("shard", "outer")) for a in axes if "mesh" in a)


def test_every_suite_has_an_l0_cell_that_exists_and_is_not_slow(items) -> None:
    sys.path.insert(0, str(REPO))
    from tests.functional.conftest import L0_CELLS

    known = {n.split("tests/functional/", 1)[-1] for n in items}
    assert [c for c in L0_CELLS if c not in known] == []
    l0 = {n: i for n, i in items.items() if "l0" in i["marks"]}
    assert len(l0) == len(set(L0_CELLS))
    assert [n for n, i in l0.items() if "slow" in i["marks"]] == []
    # A GPU-only suite's cell skips here (the harness turns a missing requires_* into a skip with the
    # reason); any other skip mark would make the cell run nowhere.
    assert [n for n, i in l0.items() if "skip" in i["marks"]
            and not any(m.startswith("requires_") for m in i["marks"])] == []
    suites = {pathlib.Path(p).name for p in (REPO / "tests" / "functional").glob("test_*.py")}
    covered = {n.split("::")[0].rsplit("/", 1)[-1] for n in l0}
    assert sorted(suites - covered) == []
