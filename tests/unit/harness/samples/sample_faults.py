"""Sample bucket for the harness self-tests: every fault kind, each followed by a test that must pass.

Not collected by the normal test run (the name does not match test_*.py); the self-tests run it in a
pytest subprocess and inspect its JUnit XML.
"""
import ctypes
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=3)


def _block() -> None:
    """A collective the faulty rank never joins, so the peers block in it."""
    dist.barrier()


def _pid(record_property) -> None:
    record_property("pid", os.getpid())


def test_ok_before(dist_env, record_property):
    _pid(record_property)
    t = torch.tensor([float(dist_env.rank)], device=dist_env.device)
    dist.all_reduce(t)
    assert t.item() == 3.0


def test_segv(dist_env, record_property):
    _pid(record_property)
    if dist_env.rank == 1:
        print("rank one about to segfault", flush=True)
        ctypes.string_at(0)
    _block()


def test_after_segv(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


def test_abort(dist_env, record_property):
    _pid(record_property)
    if dist_env.rank == 2:
        print("rank two about to abort", flush=True)
        os.abort()
    _block()


def test_after_abort(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


def test_os_exit(dist_env, record_property):
    _pid(record_property)
    if dist_env.rank == 0:
        print("rank zero about to os._exit", flush=True)
        os._exit(7)
    _block()


def test_after_exit(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


def test_sigkill(dist_env, record_property):
    _pid(record_property)
    if dist_env.rank == 1:
        print("rank one about to SIGKILL itself", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    _block()


def test_after_kill(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


def _hang_here() -> None:
    time.sleep(600)


@pytest.mark.distributed(world_size=3, timeout=4)
def test_hang(dist_env, record_property):
    _pid(record_property)
    if dist_env.rank == 0:
        _hang_here()
    _block()


def test_after_hang(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


def test_raise_while_blocked(dist_env, record_property):
    _pid(record_property)
    if dist_env.rank == 1:
        raise ValueError("rank one raised before the collective")
    t = torch.ones(1, device=dist_env.device)
    dist.all_reduce(t)


def test_after_raise(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


def test_rank2_only(dist_env, record_property):
    _pid(record_property)
    dist.barrier()
    assert dist_env.rank != 2, "only rank two disagrees"


def test_after_rank2(dist_env, record_property):
    _pid(record_property)
    dist.barrier()


@pytest.mark.distributed(world_size=2, timeout=3, bucket="first-test-timeout")
def test_first_in_bucket_keeps_its_timeout(record_property):
    """The first test of a bucket: the rank start-up allowance must not extend its own timeout."""
    _pid(record_property)
    time.sleep(10)
