"""pytest-forked coexists with the harness: a forked crash and a distributed test in one module."""
import ctypes

import pytest
import torch.distributed as dist


@pytest.mark.forked
def test_forked_crash():
    ctypes.string_at(0)


@pytest.mark.forked
def test_forked_ok():
    assert 1 + 1 == 2


@pytest.mark.distributed(world_size=2)
def test_distributed_after_forked(dist_env):
    dist.barrier()
