"""Run under ``torchrun --nproc-per-node {2,4} -m pytest`` by the self-tests."""
import os

import pytest
import torch
import torch.distributed as dist


@pytest.mark.distributed(world_size=2)
def test_ws2_sum(dist_env, shared_tmp_path):
    t = torch.tensor([float(dist_env.rank)], device=dist_env.device)
    dist.all_reduce(t)
    assert t.item() == 1.0
    (shared_tmp_path / f"r{dist_env.rank}").write_text("x")
    dist.barrier()
    assert len(list(shared_tmp_path.iterdir())) == 2


@pytest.mark.distributed(world_size=4)
def test_ws4_rank2_fails(dist_env):
    dist.barrier()
    assert dist_env.rank != 2, "rank two says no"


@pytest.mark.distributed(world_size=4)
def test_ws4_passes(dist_env):
    t = torch.ones(1, device=dist_env.device)
    dist.all_reduce(t)
    assert t.item() == 4.0


def test_single_process():
    assert int(os.environ["RANK"]) == 0
