"""A test passes, then one sleeps (in this process, or on 2 ranks) until the self-test sends the
controller SIGTERM; the last never starts. The self-test reads the JUnit the session wrote."""
import os
import pathlib
import time

import pytest


def _arrived(name: str) -> None:
    (pathlib.Path(os.environ["HARNESS_SELFTEST_MARKDIR"]) / name).write_text(str(os.getpid()))


def test_passes_first():
    pass


def test_local_sleeps():
    _arrived("local")
    time.sleep(300)


@pytest.mark.distributed(world_size=2, timeout=300)
def test_distributed_sleeps(dist_env):
    _arrived(f"rank{dist_env.rank}")
    time.sleep(300)


def test_never_reached():
    pass
