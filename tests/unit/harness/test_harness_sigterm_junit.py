"""A run ended by SIGTERM (a CI cancellation, ``timeout``) records the test it stopped as an error in
its JUnit, in spawn mode whether the test ran in the controller or on ranks (issue 52: JUnit left
it out, leaving a nameless passed ``<testcase>``, and a sign-off of that JUnit alone passed). Under
torchrun rank 0's watchdog reports it (``test_harness_torchrun_faults``)."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import pytest
from harness_selftest import REPO, SAMPLES, parse_junit

from harness.report import signoff

MESSAGE = "interrupted by SIGTERM while this test ran: the session was stopped before it finished"


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as test_harness_interrupt: a background job ignores it


def _run_until_sigterm(tmp: pathlib.Path, sleeper: str, marks: tuple[str, ...]) -> tuple[pathlib.Path, str]:
    """The sample run with ``sleeper`` between the other two tests; SIGTERM once it sleeps."""
    markdir = tmp / "marks"
    markdir.mkdir()
    junit = tmp / "run" / "L0.xml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "HARNESS_"))}
    env["HARNESS_SELFTEST_MARKDIR"] = str(markdir)
    cmd = [sys.executable, "-m", "pytest", str(SAMPLES / "sample_sigterm.py"), "-p", "no:cacheprovider", "-q",
           "-k", f"test_passes_first or {sleeper} or test_never_reached", f"--junitxml={junit}",
           f"--basetemp={tmp / 'bt'}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 240
        while not all((markdir / m).exists() for m in marks) and proc.poll() is None:
            assert time.monotonic() < deadline, f"{sleeper} never started"
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return junit, out


@pytest.mark.parametrize("sleeper, marks", [("test_local_sleeps", ("local",)),
                                            ("test_distributed_sleeps", ("rank0", "rank1"))],
                         ids=["in-the-controller", "on-ranks"])
def test_the_test_sigterm_stopped_is_an_error_in_junit(tmp_path, sleeper, marks) -> None:
    junit, out = _run_until_sigterm(tmp_path, sleeper, marks)
    cases = parse_junit(junit)
    assert set(cases) == {"test_passes_first", sleeper}, (set(cases), out[-3000:])  # a nameless case: None
    assert cases["test_passes_first"].outcome == "passed"
    stopped = cases[sleeper]
    assert stopped.outcome == "error" and MESSAGE in stopped.message, (stopped, out[-3000:])
    # the JUnit alone (as a CI dashboard sees it): the stopped test fails the sign-off
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(junit, alone / junit.name)
    summary = _signoff(alone / junit.name, tmp_path / "s1.json")
    assert summary["verdict"] == "FAIL" and summary["rules"]["no failures"] == (False, "1 test(s) errored")
    # with the sidecar: the same error, and the test after it never ran
    summary = _signoff(junit.parent, tmp_path / "s2.json")
    assert summary["rules"]["no failures"] == (False, "1 test(s) errored")
    assert summary["rules"]["nothing left unrun"] == (False, "1 test(s) never ran")
    counts = summary["counts"]
    assert (counts["tests"], counts["passed"], counts["errors"], counts["not run"]) == (3, 1, 1, 1), summary


def _signoff(junit: pathlib.Path, out: pathlib.Path) -> dict:
    """The sign-off's verdict, rules (name: (ok, evidence)) and counts of ``junit``."""
    code = signoff.main(["--junit", str(junit), "--json", str(out)])
    data = json.loads(out.read_text())
    assert code == (signoff.EXIT_PASS if data["verdict"] == "PASS" else signoff.EXIT_FAIL)
    return {"verdict": data["verdict"], "counts": data["counts"],
            "rules": {r["name"]: (r["ok"], r["detail"]) for r in data["rules"]}}
