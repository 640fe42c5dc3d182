"""No rank process outlives the session: Ctrl-C (SIGINT) of the controller, or even SIGKILL of it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from harness_selftest import REPO, SAMPLES, pid_alive


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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
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
        pids = [int(p.read_text()) for p in piddir.glob("rank*.pid")]
        assert all(pid_alive(p) for p in pids)
        proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
            pytest.fail(f"controller still running 60 s after {sig.name}; its output:\n{out[-4000:]}")
        _wait_for(lambda: not any(pid_alive(p) for p in pids), 10, f"rank processes {pids} to exit")
        if sig == signal.SIGINT:
            assert "KeyboardInterrupt" in out or "Interrupted" in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
