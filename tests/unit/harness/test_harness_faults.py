"""Every fault a bucket must report (rank death, timeout, raise while peers block, a rank-local failure):
outcome, rank, signal, stack, and that the following tests run."""
from __future__ import annotations

import pytest
from harness_selftest import SampleRun, pid_alive

FOLLOW_UPS = ["test_after_segv", "test_after_abort", "test_after_exit", "test_after_kill",
              "test_after_hang", "test_after_raise", "test_after_rank2"]


@pytest.mark.parametrize("name, rank, what, stack_frame", [
    ("test_segv", 1, "killed by signal SIGSEGV", "in test_segv"),
    ("test_abort", 2, "killed by signal SIGABRT", "in test_abort"),
    ("test_os_exit", 0, "exited with code 7", "in test_os_exit"),
])
def test_rank_death_reports_rank_signal_and_stack(faults_run: SampleRun, name, rank, what, stack_frame):
    case = faults_run.cases[name]
    assert case.outcome == "failed", faults_run.output[-3000:]
    assert f"rank {rank} {what}" in case.message
    stack = case.text.split(f"rank {rank} Python stack (faulthandler)", 1)[1].split(f"rank {rank} last output lines")[0]
    assert "sample_faults.py" in stack and stack_frame in stack, case.text[:3000]
    assert case.prop(f"rank{rank}") == "died"


def test_last_output_lines_of_dead_rank(faults_run: SampleRun):
    assert "rank one about to segfault" in faults_run.cases["test_segv"].text
    assert "rank zero about to os._exit" in faults_run.cases["test_os_exit"].text


def test_sigkill_names_signal_and_explains_missing_stack(faults_run: SampleRun):
    case = faults_run.cases["test_sigkill"]
    assert case.outcome == "failed"
    assert "rank 1 killed by signal SIGKILL" in case.message
    assert "cannot be intercepted" in case.text
    assert "rank one about to SIGKILL itself" in case.text


def test_timeout_shows_every_rank_stack(faults_run: SampleRun):
    case = faults_run.cases["test_hang"]
    assert case.outcome == "failed"
    assert "exceeded its timeout of 4 s" in case.message
    for r in range(3):
        section = case.text.split(f"rank {r} stack at timeout", 1)[1].split("----------", 2)[1]
        assert "in test_hang" in section, (r, case.text[:4000])
    assert "in _hang_here" in case.text


def test_raise_while_peers_block_fails_fast_naming_raiser(faults_run: SampleRun):
    case = faults_run.cases["test_raise_while_blocked"]
    assert case.outcome == "failed"
    assert case.message.startswith("[rank 1] ValueError: rank one raised before the collective"), case.message
    assert "rank 1 (cause)" in case.text
    assert "grace period" in case.text
    for r in (0, 2):
        assert f"rank {r} stack while blocked" in case.text
    assert "Connection closed" not in case.message


def test_failure_only_on_rank2(faults_run: SampleRun):
    case = faults_run.cases["test_rank2_only"]
    assert case.outcome == "failed"
    assert case.message == "[rank 2] AssertionError: only rank two disagrees"
    assert "only rank two disagrees" in case.text
    assert [case.prop(f"rank{r}") for r in range(3)] == ["passed", "passed", "failed"]


def test_followups_pass_in_fresh_buckets(faults_run: SampleRun):
    for name in FOLLOW_UPS + ["test_ok_before"]:
        assert faults_run.cases[name].outcome == "passed", (name, faults_run.cases[name].text[:2000])
    # after each fault the next test runs in new processes; after a plain failure, in the same ones
    before = faults_run.cases["test_ok_before"].rank_props("pid")
    after = faults_run.cases["test_after_segv"].rank_props("pid")
    assert before and after and not set(before.values()) & set(after.values())
    cases = faults_run.cases
    assert cases["test_rank2_only"].rank_props("pid") == cases["test_after_rank2"].rank_props("pid")


def test_fault_bucket_raise_is_fast(faults_run: SampleRun):
    """Raise-while-blocked ends after the 3 s grace period (+ stack dumps), not the 120 s default timeout."""
    case = faults_run.cases["test_raise_while_blocked"]
    assert 3.0 <= case.time < 60.0, case.time


def test_no_rank_process_survives(faults_run: SampleRun):
    pids = faults_run.all_rank_pids()
    assert len(pids) >= 3 * 7
    assert [p for p in pids if pid_alive(p)] == []
