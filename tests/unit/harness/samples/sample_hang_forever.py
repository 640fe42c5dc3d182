"""Ranks write their pids then sleep; the self-test interrupts the controller (Ctrl-C)."""
import os
import pathlib
import time

import pytest


@pytest.mark.distributed(world_size=2, timeout=300)
def test_sleep(dist_env):
    where = pathlib.Path(os.environ["HARNESS_SELFTEST_PIDDIR"])
    (where / f"rank{dist_env.rank}.pid").write_text(str(os.getpid()))
    time.sleep(300)
