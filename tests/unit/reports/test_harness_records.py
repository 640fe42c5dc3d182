"""What the harness records for the sign-off, from real pytest sessions on CPU/gloo: matrix axes
(``@pytest.mark.matrix``), the JUnit sidecar (environment, per-rank outcomes, buckets), reruns that
mark a test flaky, the journal a killed session leaves, and the mutant hook's refusal to pretend.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from harness.report.runs import load_runs

REPO = pathlib.Path(__file__).resolve().parents[3]
INI = "[pytest]\nharness_matrix_axes = mesh zero model dtype\n"

SUITE = textwrap.dedent('''
    import pathlib
    import pytest
    from harness import matrix

    pytestmark = pytest.mark.matrix(mesh="dp2", dtype="fp32")

    @pytest.mark.distributed(world_size=2)
    @pytest.mark.matrix(zero=matrix.param("strategy", {0: "no_shard", 3: "optim_grads_params"}.get))
    @pytest.mark.parametrize("strategy", [0, 3])
    def test_dist(dist_env, strategy):
        assert not (strategy == 3 and dist_env.rank == 1), "rank-local mismatch"

    @pytest.mark.distributed(world_size=2)
    def test_flaky_dist(dist_env, session_shared_tmp_path):
        flag = session_shared_tmp_path / "tried"
        if dist_env.rank == 0 and not flag.exists():
            flag.write_text("1")
            raise AssertionError("first attempt fails")

    @pytest.mark.matrix(mesh=None, model="none")
    def test_single_process():
        pass
''')


def run_pytest(tmp: pathlib.Path, *args: str, env_extra: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", HARNESS_FORCE_CPU="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "pytest", "-p", "harness.plugin", "-p", "harness.regression_marker",
           "-p", "no:cacheprovider", "-q", *args]
    return subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)


def write_suite(tmp: pathlib.Path, source: str, name: str = "test_demo.py") -> None:
    (tmp / "tests").mkdir(exist_ok=True)
    (tmp / "tests" / name).write_text(source)
    (tmp / "pytest.ini").write_text(INI)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, subprocess.CompletedProcess[str]]:
    tmp = tmp_path_factory.mktemp("records")
    write_suite(tmp, SUITE)
    proc = run_pytest(tmp, "--junitxml=out/run.xml", "--harness-reruns=1", "tests")
    return tmp, proc


def test_axes_ranks_and_buckets_reach_the_sidecar(recorded) -> None:
    tmp, proc = recorded
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp / "out" / "run.harness.json").read_text())
    tests = data["tests"]
    ok, bad = tests["tests/test_demo.py::test_dist[0]"], tests["tests/test_demo.py::test_dist[3]"]
    assert ok["axes"] == {"mesh": "dp2", "zero": "no_shard", "dtype": "fp32"}  # ini order, None drops mesh below
    assert tests["tests/test_demo.py::test_single_process"]["axes"] == {"model": "none", "dtype": "fp32"}
    assert {r: v["outcome"] for r, v in bad["ranks"].items()} == {"0": "passed", "1": "failed"}
    assert bad["outcome"] == "failed" and "rank-local mismatch" in bad["message"]
    assert ok["bucket"]["started"] is True and ok["bucket"]["startup_s"] > 0
    assert ok["bucket"]["label"] == "tests/test_demo.py::ws2" and ok["wall_s"] >= ok["bucket"]["startup_s"]
    env = data["environment"]
    assert env["torch"] and env["backend"] == "gloo (cpu forced)" and "gpu_count" in env and "nccl" in env
    assert data["complete"] is True and data["unfinished"] == [] and len(data["expected"]) == 4
    assert not (tmp / "out" / "run.harness.jsonl").exists()  # the journal is folded into the sidecar


def test_rerun_marks_failed_then_passed_as_flaky_never_passed(recorded) -> None:
    tmp, proc = recorded
    summary = proc.stdout.strip().splitlines()[-1]
    assert summary.startswith("1 failed, 2 passed") and "1 flaky" in summary, summary
    (run,) = load_runs([tmp / "out" / "run.xml"])
    cases = {c.test_id: c for c in run.cases}
    flaky = cases["tests/test_demo.py::test_flaky_dist"]
    assert flaky.outcome == "flaky" and flaky.prop("harness_flaky") == "failed 1 of 2 attempts, then passed"
    assert "first attempt fails" in flaky.details
    bad = cases["tests/test_demo.py::test_dist[3]"]
    assert bad.outcome == "failed" and bad.prop("harness_reruns") == "failed all 2 attempts"
    assert cases["tests/test_demo.py::test_dist[0]"].axes == (("mesh", "dp2"), ("zero", "no_shard"), ("dtype", "fp32"))
    # the rerun of a distributed test starts a fresh bucket
    assert json.loads((tmp / "out" / "run.harness.json").read_text())["tests"][
        "tests/test_demo.py::test_flaky_dist"]["bucket"]["started"] is True


@pytest.mark.parametrize(("mark", "message"), [
    ('pytest.mark.matrix(colour="red")', "unknown matrix axis 'colour'; allowed (harness_matrix_axes)"),
    ('pytest.mark.matrix(zero=matrix.param("nope"))', "the test has no parametrisation argument 'nope'"),
    ('pytest.mark.matrix("dp2")', "matrix() takes keyword arguments only"),
])
def test_bad_matrix_marks_are_collection_errors(tmp_path, mark, message) -> None:
    write_suite(tmp_path, f"import pytest\nfrom harness import matrix\n\n@{mark}\ndef test_x():\n    pass\n")
    proc = run_pytest(tmp_path, "--co", "tests", timeout=120)
    assert proc.returncode != 0
    assert message in proc.stdout, proc.stdout[-2000:]


def test_a_killed_session_leaves_a_journal_the_signoff_reads(tmp_path) -> None:
    write_suite(tmp_path, textwrap.dedent('''
        import pathlib, time
        def test_first():
            pass
        def test_hangs():
            pathlib.Path("started").write_text("1")
            time.sleep(600)
        def test_never():
            pass
    '''))
    env = dict(os.environ, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", HARNESS_FORCE_CPU="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "harness.plugin", "-p", "no:cacheprovider", "-q",
                             "--junitxml=out/run.xml", "tests"], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "started").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert (tmp_path / "started").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert not (tmp_path / "out" / "run.xml").exists()
    (run,) = load_runs([tmp_path / "out" / "run.xml"])  # the JUnit path: its journal stands in for it
    outcomes = {c.test_id: c.outcome for c in run.cases}
    assert outcomes == {"tests/test_demo.py::test_first": "passed", "tests/test_demo.py::test_hangs": "error",
                        "tests/test_demo.py::test_never": "not run"}
    assert run.complete is False and run.environment["torch"]


def test_a_mutant_that_does_not_apply_is_a_usage_error(tmp_path) -> None:
    write_suite(tmp_path, "def test_x():\n    pass\n")
    proc = run_pytest(tmp_path, "tests", env_extra={"HARNESS_MUTANT": "harness.matrix:no_such_function"},
                      timeout=120)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "HARNESS_MUTANT='harness.matrix:no_such_function' did not apply" in proc.stdout + proc.stderr
