"""Ranks write their pids, start a child in a new session, then sleep; the self-test interrupts the
controller (Ctrl-C, SIGTERM or SIGKILL) and checks that none of them survives."""
import os
import pathlib
import subprocess
import time

import pytest


@pytest.mark.distributed(world_size=2, timeout=300)
def test_sleep(dist_env):
    where = pathlib.Path(os.environ["HARNESS_SELFTEST_PIDDIR"])
    child = subprocess.Popen(["setsid", "sleep", "1000"])
    (where / f"child{dist_env.rank}.pid").write_text(str(child.pid))
    (where / f"rank{dist_env.rank}.pid").write_text(str(os.getpid()))
    time.sleep(300)
