"""The sign-off report reads what the harness core really writes for distributed tests.

Runs a tiny distributed suite through the harness plugin (spawn mode, CPU/gloo, two
ranks) and checks that the report names the failing rank, its cause, the matrix axis
and the regression, so a change of the harness's JUnit format breaks this test rather
than silently emptying the report's rank column.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

from harness.report.junit_read import FAILED, failing_ranks, one_line_cause, read_junit
from harness.report.regressions import regression_rows

REPO = pathlib.Path(__file__).resolve().parents[3]

SUITE = textwrap.dedent('''
    import os
    import pytest

    @pytest.mark.regression("demo-rank-bug", description="demo")
    @pytest.mark.distributed(world_size=2)
    @pytest.mark.parametrize("mode", ["ok", "fail", "crash"])
    def test_ranks(dist_env, mode):
        if mode == "fail" and dist_env.rank == 1:
            assert 1 == 2, "rank-local mismatch"
        if mode == "crash" and dist_env.rank == 0:
            os._exit(7)
''')


def test_report_of_a_real_distributed_run(tmp_path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_dist_demo.py").write_text(SUITE)
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", HARNESS_FORCE_CPU="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "harness.plugin", "-p", "harness.regression_marker",
         "-p", "no:cacheprovider", "-q", "--junitxml=run.xml", "tests"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    cases = {c.name: c for c in read_junit([tmp_path / "run.xml"])}
    assert set(cases) == {"test_ranks[ok]", "test_ranks[fail]", "test_ranks[crash]"}
    assert cases["test_ranks[ok]"].outcome == "passed"
    fail, crash = cases["test_ranks[fail]"], cases["test_ranks[crash]"]
    assert (fail.outcome, failing_ranks(fail)) == (FAILED, [1])
    assert "rank-local mismatch" in one_line_cause(fail)
    assert (crash.outcome, failing_ranks(crash)) == (FAILED, [0])
    assert "died" in one_line_cause(crash)
    assert crash.params == (("mode", "crash"),)
    rows = regression_rows(list(cases.values()), {"demo-rank-bug": ""})
    assert [(r.bug_id, r.status) for r in rows] == [("demo-rank-bug", "FAILED")]
