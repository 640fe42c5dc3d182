"""Faults under torchrun, in unmarked tests as a plain suite has them: a hang on rank 0 or on another
rank, a raise while rank 0 blocks in a collective, a crash on either. Each ends the session quickly
with the faulty test failed (every rank's stack where a process is left to ask), the tests before it
in rank 0's JUnit, and no process left behind."""
from __future__ import annotations

import pytest
from harness_selftest import pid_alive
from test_harness_torchrun import torchrun

TIMEOUT_S = 6


def _run(tmp_path, fault: str):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = {"HARNESS_SELFTEST_FAULT": fault, "HARNESS_SELFTEST_PIDDIR": str(piddir)}
    proc, cases, elapsed = torchrun(tmp_path, 2, "sample_torchrun_faults.py", env=env,
                                    args=(f"--harness-timeout={TIMEOUT_S}",))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert cases.get("test_before") is not None and cases["test_before"].outcome == "passed", out[-4000:]
    assert "test_after" not in cases, "the session must stop after the fault"
    pids = [int(p.read_text()) for p in piddir.glob("*.pid")]
    assert len(pids) == 2 and not [p for p in pids if pid_alive(p)]
    return cases, out, elapsed


@pytest.mark.parametrize("rank", [0, 1])
def test_hang_fails_the_test_with_every_rank_stack(tmp_path, rank):
    cases, out, elapsed = _run(tmp_path, f"hang{rank}")
    case = cases["test_fault"]
    assert case.outcome == "failed"
    assert f"exceeded its timeout of {TIMEOUT_S} s on rank(s) [{rank}]" in case.message, case.message
    hung = case.text.split(f"rank {rank} stack at timeout", 1)[1]
    assert "in _hang_here" in hung.split("----------", 2)[1], case.text[:4000]
    other = 1 - rank
    assert f"rank {other} stack at timeout" in case.text
    assert f"rank {rank} starts the faulty test" in case.text  # the stuck rank's output so far
    assert elapsed < 240, elapsed  # no minute-long wait for the stuck rank after the report


def test_raise_while_rank0_blocks_names_the_raiser(tmp_path):
    cases, out, _ = _run(tmp_path, "raise1")
    case = cases["test_fault"]
    assert case.outcome == "failed"
    assert case.message.startswith("[rank 1] ValueError: rank one raised before the collective"), case.message
    assert "grace period" in case.message
    assert "all_reduce" in case.text.split("rank 0 stack while blocked", 1)[1]


def test_crash_on_rank1_is_reported_by_rank0(tmp_path):
    cases, out, _ = _run(tmp_path, "crash1")
    case = cases["test_fault"]
    assert case.outcome == "failed"
    assert "rank(s) [1] died" in case.message, case.message
    assert "Fatal Python error: Segmentation fault" in out


def test_crash_on_rank0_keeps_the_results_before_it(tmp_path):
    """Nothing in a segfaulting rank 0 can report: its JUnit snapshot holds the tests before, rank 1
    names the test it died in, its own stderr has the stack."""
    cases, out, _ = _run(tmp_path, "crash0")
    assert "test_fault" not in cases
    assert "Fatal Python error: Segmentation fault" in out and "in test_fault" in out
    assert "[harness] rank 0 (pid" in out and "died during" in out and "::test_fault" in out, out[-3000:]
