"""Tests that start processes trying to outlive them (self-test sample): one in a new session
(``setsid``), one double-forked so that it is an orphan from the start; then a rank that dies
abruptly right after starting them. The self-test checks that none of them survives the session."""
import os
import pathlib
import signal
import subprocess
import time

import pytest

pytestmark = pytest.mark.distributed(world_size=2)


def spawn_escapees(tag: str, rank: int) -> None:
    """Start both kinds and record their pids in ``HARNESS_SELFTEST_PIDDIR``."""
    where = pathlib.Path(os.environ["HARNESS_SELFTEST_PIDDIR"])
    child = subprocess.Popen(["setsid", "sleep", "1000"])
    (where / f"{tag}-setsid-{rank}.pid").write_text(str(child.pid))
    daemon_file = where / f"{tag}-daemon-{rank}.pid"
    subprocess.run(["setsid", "-f", "sh", "-c", f"echo $$ > {daemon_file}.tmp; mv {daemon_file}.tmp {daemon_file}; "
                    "exec sleep 1000"], check=True)
    deadline = time.monotonic() + 30
    while not daemon_file.exists():
        assert time.monotonic() < deadline, "the double-forked sleep did not start"
        time.sleep(0.05)


def test_leaves_processes_behind(dist_env):
    spawn_escapees("passing", dist_env.rank)


def test_dies_right_after_starting_them(dist_env):
    spawn_escapees("dying", dist_env.rank)
    if dist_env.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
