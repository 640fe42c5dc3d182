"""torchrun mode: a rank ends with pytest's exit status when a process group is still alive after the
session (issue 52, item 19: a rank died with SIGABRT, "terminate called without an active
exception", at exit after a refused checkpoint load, its results already written). The sample makes
the abort certain on main: a gloo worker runs a Python callback while its rank finalizes."""
from __future__ import annotations

import pathlib
import re

import pytest
from test_harness_torchrun import torchrun


@pytest.mark.parametrize("fail", [False, True], ids=["passing", "failing"])
def test_rank_with_a_live_group_exits_with_pytest_status(tmp_path, fail):
    # The rank logs go to a directory of this test's own: by default they sit in the sample run's
    # pytest basetemp (/tmp/pytest-of-<user>/pytest-<N>), which pytest deletes once three newer
    # sessions have started; with other pytest runs beside this one it was gone before the read below.
    shared = tmp_path / "shared"
    shared.mkdir()
    proc, cases, _ = torchrun(tmp_path, 2, "sample_torchrun_exit.py",
                              env={"SAMPLE_EXIT_FAIL": "1" if fail else "0", "HARNESS_SHARED_DIR": str(shared)})
    out = proc.stdout + proc.stderr
    assert "terminate called" not in out and "SIGABRT" not in out and "exitcode  : -6" not in out, out[-3000:]
    assert proc.returncode == (1 if fail else 0), out[-3000:]
    assert cases["test_refused_load_then_goes_on"].outcome == "passed", out[-3000:]
    assert cases["test_dtensor_on_the_harness_group"].outcome == "passed", out[-3000:]
    assert cases["test_fails_on_purpose"].outcome == ("failed" if fail else "skipped"), out[-3000:]
    # Every rank: at exit, the group the refused load's error holds still runs its 3 gloo threads (the
    # sample's own exit handler sees them), the harness's own group (held by DTensor's caches) was freed,
    # and the rank says it ends without interpreter finalization.
    counts = re.findall(r"\[sample-exit\] rank (\d+): (\d+) thread\(s\) at exit, (\d+) at import", out)
    assert sorted(int(r) for r, _, _ in counts) == [0, 1], out[-3000:]
    found = re.search(r"rank logs and spilled output in (\S+)", out)
    assert found, out[-3000:]
    for r in range(2):
        log = (pathlib.Path(found.group(1)) / f"rank{r}.log").read_text()
        assert "3 gloo thread(s) still run (a process group torch still holds): this rank ends without " \
               "interpreter finalization" in log, log[-2000:]
