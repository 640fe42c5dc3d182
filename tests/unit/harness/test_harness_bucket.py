"""A 20-test 4-rank bucket runs in one set of processes and reports 20 results."""
from __future__ import annotations

import os

from harness_selftest import SampleRun, pid_alive

from harness.spawn.bucket import thread_env


def test_twenty_tests_one_set_of_processes(bucket20_run: SampleRun):
    cases = bucket20_run.cases
    assert bucket20_run.returncode == 0, bucket20_run.output[-3000:]
    assert len(cases) == 20 and all(c.outcome == "passed" for c in cases.values())
    per_test = [c.rank_props("pid") for c in cases.values()]
    assert all(sorted(p) == [0, 1, 2, 3] for p in per_test)
    assert all(p == per_test[0] for p in per_test), "rank pids changed within the bucket"
    assert len(set(per_test[0].values())) == 4
    assert all(c.prop("controller_pid") for c in cases.values())  # one controller, same on all ranks
    assert all(c.prop(f"rank{r}") == "passed" for c in cases.values() for r in range(4))


def test_ranks_of_a_multi_rank_bucket_get_one_thread_unless_the_user_chose(bucket20_run: SampleRun):
    """As under torchrun: OMP_NUM_THREADS=1 when unset, so N ranks do not oversubscribe the CPU."""
    user = os.environ.get("OMP_NUM_THREADS")
    expected = "1/1" if user is None else f"{user}/{int(user)}"
    seen = {c.prop("omp") for c in bucket20_run.cases.values()}  # one value: every rank agreed
    assert seen == {expected}, seen


def test_thread_env_keeps_the_users_choice_and_single_rank_defaults():
    assert thread_env({}, 2) == {"OMP_NUM_THREADS": "1"}
    assert thread_env({"OMP_NUM_THREADS": "3"}, 4) == {}
    assert thread_env({}, 1) == {}  # one rank: torch's own default, as torchrun with one process


def test_bucket_processes_gone_after_session(bucket20_run: SampleRun):
    pids = bucket20_run.all_rank_pids()
    assert len(pids) == 4
    assert [p for p in pids if pid_alive(p)] == []


def test_skipped_tests_do_not_restart_the_bucket(tmp_path):
    from harness_selftest import run_samples

    run = run_samples(tmp_path, "sample_bucket_skips.py")
    assert run.returncode == 0, run.output[-3000:]
    outcomes = {name.rsplit("::", 1)[-1]: c.outcome for name, c in run.cases.items()}
    assert outcomes == {"test_a": "passed", "test_b": "skipped", "test_c": "skipped",
                        "test_d": "passed", "test_e": "skipped"}, outcomes
    pids = {name.rsplit("::", 1)[-1]: c.rank_props("pid") for name, c in run.cases.items()
            if c.outcome == "passed"}
    assert pids["test_a"] == pids["test_d"], "the bucket was restarted around the skipped tests"
