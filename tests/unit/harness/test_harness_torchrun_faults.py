"""Faults under torchrun, in unmarked tests as a plain suite has them: a hang on rank 0 or on another
rank, a raise while rank 0 blocks in a collective, a crash on either. Each ends the session quickly
with the faulty test failed (every rank's stack where a process is left to ask), the tests before it
in rank 0's JUnit, and no process left behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from harness_selftest import REPO, SAMPLES, parse_junit, pid_alive
from test_harness_torchrun import torchrun

TIMEOUT_S = 6


def _run(tmp_path, fault: str):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = {"HARNESS_SELFTEST_FAULT": fault, "HARNESS_SELFTEST_PIDDIR": str(piddir)}
    proc, cases, _ = torchrun(tmp_path, 2, "sample_torchrun_faults.py", env=env,
                              args=(f"--harness-timeout={TIMEOUT_S}",))
    junit = tmp_path / "junit.xml"
    after_junit = time.time() - junit.stat().st_mtime if junit.exists() else float("inf")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert cases.get("test_before") is not None and cases["test_before"].outcome == "passed", out[-4000:]
    assert "test_after" not in cases, "the session must stop after the fault"
    pids = [int(p.read_text()) for p in piddir.glob("*.pid")]
    assert len(pids) == 2 and not [p for p in pids if pid_alive(p)]
    return cases, out, after_junit


@pytest.mark.parametrize("rank", [0, 1])
def test_hang_fails_the_test_with_every_rank_stack(tmp_path, rank):
    cases, out, after_junit = _run(tmp_path, f"hang{rank}")
    case = cases["test_fault"]
    assert case.outcome == "failed"
    assert f"exceeded its timeout of {TIMEOUT_S} s on rank(s) [{rank}]" in case.message, case.message
    hung = case.text.split(f"rank {rank} stack at timeout", 1)[1]
    assert "in _hang_here" in hung.split("----------", 2)[1], case.text[:4000]
    other = 1 - rank
    assert f"rank {other} stack at timeout" in case.text
    assert f"rank {rank} starts the faulty test" in case.text  # the stuck rank's output so far
    assert after_junit < 30, after_junit  # the job ends soon after rank 0 wrote JUnit, stuck rank included


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
    # Seen by rank 0 itself, or when torchrun's SIGTERM comes first: the same message either way.
    assert case.message.startswith("rank process died: rank 1 (pid "), case.message
    assert "Fatal Python error: Segmentation fault" in out


def test_crash_on_rank0_keeps_the_results_before_it(tmp_path):
    """Nothing in a segfaulting rank 0 can report: its JUnit snapshot holds the tests before, rank 1
    names the test it died in, its own stderr has the stack."""
    cases, out, _ = _run(tmp_path, "crash0")
    assert "test_fault" not in cases
    assert "Fatal Python error: Segmentation fault" in out and "in test_fault" in out
    assert "[harness] rank 0 (pid" in out and "died during" in out and "::test_fault" in out, out[-3000:]


def test_sigterm_to_torchrun_reports_the_running_test(tmp_path):
    """A cancelled job: torchrun passes SIGTERM on to every rank; rank 0 fails the running test with
    every rank's stack and writes JUnit, within torchrun's 30 s before SIGKILL."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    junit = tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env.update({"HARNESS_SELFTEST_FAULT": "sleep", "HARNESS_SELFTEST_PIDDIR": str(piddir)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "pytest",
         str(SAMPLES / "sample_torchrun_faults.py"), "-p", "no:cacheprovider", f"--junitxml={junit}",
         "--harness-timeout=300"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while len(list(piddir.glob("*.started"))) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "the ranks did not reach the test"
            time.sleep(0.2)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        ended = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cases = parse_junit(junit) if junit.exists() else {}
    assert cases.get("test_before") is not None and cases["test_before"].outcome == "passed", out[-4000:]
    case = cases["test_fault"]
    assert case.outcome == "failed" and "received SIGTERM" in case.message, case.message
    for r in (0, 1):
        assert "in _hang_here" in case.text.split(f"rank {r} stack at SIGTERM", 1)[1].split("----------", 2)[1]
    assert ended < 30, ended  # no rank needed torchrun's SIGKILL
    pids = [int(p.read_text()) for p in piddir.glob("*.pid")]
    assert len(pids) == 2 and not [p for p in pids if pid_alive(p)]
