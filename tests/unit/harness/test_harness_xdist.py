"""Under xdist: buckets stay on one worker (loadgroup by default), concurrent buckets never share a
rendezvous, and with (fake) GPUs each worker leases disjoint GPUs for its bucket."""
from __future__ import annotations

import shutil

import pytest
from harness_selftest import SAMPLES, pid_alive, run_samples


# Two xdist workers each start a 2-rank bucket at once (about 80 s on 2 loaded cores). The lease
# scheduling itself is covered by tests/unit/gpu_lease; this checks the controller's use of it.
@pytest.mark.slow
def test_concurrent_buckets_have_distinct_rendezvous_and_gpus(tmp_path):
    run = run_samples(tmp_path, "sample_concurrent_a.py", "sample_concurrent_b.py", args=("-n", "2"),
                      env={"HARNESS_FAKE_GPUS": "4", "HARNESS_LOCK_DIR": str(tmp_path / "locks")}, timeout=900)
    a, b = run.cases["test_bucket_a"], run.cases["test_bucket_b"]
    assert a.outcome == b.outcome == "passed", run.output[-3000:]
    # the tests only pass if both buckets were up at the same time (file rendezvous in the samples)
    assert a.prop("store_port") and b.prop("store_port") and a.prop("store_port") != b.prop("store_port")
    assert a.prop("controller_pid") != b.prop("controller_pid")  # two xdist workers
    gpus_a, gpus_b = a.rank_props("cuda_visible_devices"), b.rank_props("cuda_visible_devices")
    assert len(gpus_a) == len(gpus_b) == 2, (a.props, b.props)
    all_ids = list(gpus_a.values()) + list(gpus_b.values())
    assert len(set(all_ids)) == 4 and set(all_ids) <= {"0", "1", "2", "3"}, all_ids
    assert [p for p in run.all_rank_pids() if pid_alive(p)] == []


def test_bucket_stays_on_one_worker_by_default(tmp_path):
    run = run_samples(tmp_path, "sample_bucket20.py", args=("-n", "2"), timeout=400)
    assert run.returncode == 0, run.output[-3000:]
    pids = [c.rank_props("pid") for c in run.cases.values()]
    assert len(pids) == 20 and all(p == pids[0] for p in pids)
    assert len({c.prop("controller_pid") for c in run.cases.values()}) == 1


_SELECT_BY_NODE_ID = '''"""Marks tests ``picked`` by node id, as tests/functional/conftest.py marks its L0 cells."""
import pytest

PICKED = ("sample_bucket20.py::test_trivial[3]", "sample_bucket20.py::test_trivial[11]",
          "sample_bucket20.py::test_trivial[17]")


def pytest_configure(config):
    config.addinivalue_line("markers", "picked: selected by node id")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        if item.nodeid.endswith(PICKED):
            item.add_marker(pytest.mark.picked)
'''


def test_a_selection_by_node_id_keeps_its_tests_and_their_bucket(tmp_path):
    """A conftest that picks tests by node id (as ``tests/functional/conftest.py`` picks its L0
    cells) sees the real ids under ``-n 2``: the ``@group`` suffix the scheduler needs is on the
    ids only while a worker reports them (with pytest 9.2, where the harness writes it, adding it
    earlier once dropped 43 of the 92 L0 tests); the picked tests share one set of rank processes."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(_SELECT_BY_NODE_ID)
    shutil.copy(SAMPLES / "sample_bucket20.py", suite)
    run = run_samples(tmp_path, str(suite / "sample_bucket20.py"), args=("-n", "2", "-m", "picked"), timeout=400)
    assert run.returncode == 0, run.output[-3000:]
    assert sorted(run.cases) == ["test_trivial[11]", "test_trivial[17]", "test_trivial[3]"], run.output[-3000:]
    pids = [c.rank_props("pid") for c in run.cases.values()]
    assert all(p == pids[0] for p in pids), pids
