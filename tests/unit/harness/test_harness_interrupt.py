"""Nothing a test started outlives the session: not the rank processes, not the children tests start in
a new session, whether the run ends normally, a rank dies, or the controller gets Ctrl-C (SIGINT),
SIGTERM (CI cancellation, ``timeout``) or SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from harness_selftest import REPO, SAMPLES, pid_alive, run_samples


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A shell starts background jobs
    with SIGINT ignored, that disposition survives exec, and Python then keeps ignoring it (no
    KeyboardInterrupt): run from such a job, the controller could never see the Ctrl-C this
    test sends, whatever the harness does."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pids(piddir, pattern: str) -> list[int]:
    return [int(p.read_text()) for p in piddir.glob(pattern)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"])
def test_controller_interrupt_leaves_no_rank(tmp_path, sig):
    piddir = tmp_path / "pids"
    piddir.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["HARNESS_SELFTEST_PIDDIR"] = str(piddir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", str(SAMPLES / "sample_hang_forever.py"), "-p", "no:cacheprovider", "-q",
         f"--basetemp={tmp_path / 'bt'}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_default_sigint)
    try:
        _wait_for(lambda: len(list(piddir.glob("rank*.pid"))) == 2 or proc.poll() is not None, 180, "rank pids")
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        pids = _pids(piddir, "rank*.pid") + _pids(piddir, "child*.pid")
        assert len(pids) == 4 and all(pid_alive(p) for p in pids)
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"controller still running 60 s after {sig.name}; its output:\n{out[-4000:]}")
        _wait_for(lambda: not any(pid_alive(p) for p in pids), 10, f"ranks and their children {pids} to exit")
        if sig != signal.SIGKILL:
            assert "KeyboardInterrupt" in out or "Interrupted" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_processes_started_by_tests_do_not_outlive_the_session(tmp_path):
    """A child in a new session, a double-forked orphan, and both again on a rank that is SIGKILLed."""
    piddir = tmp_path / "pids"
    piddir.mkdir()
    run = run_samples(tmp_path, "sample_orphans.py", env={"HARNESS_SELFTEST_PIDDIR": str(piddir)}, timeout=300)
    cases = {name.rsplit("::", 1)[-1]: c for name, c in run.cases.items()}
    assert cases["test_leaves_processes_behind"].outcome == "passed", run.output[-3000:]
    assert "rank 1 killed by signal SIGKILL" in cases["test_dies_right_after_starting_them"].message
    pids = {p.name: int(p.read_text()) for p in piddir.glob("*.pid")}
    assert len(pids) == 8, sorted(pids)
    _wait_for(lambda: not any(pid_alive(p) for p in pids.values()), 10,
              f"processes started by tests to exit: {[n for n, p in pids.items() if pid_alive(p)]}")
