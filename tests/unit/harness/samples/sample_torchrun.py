"""Run under ``torchrun --nproc-per-node {2,4} -m pytest`` by the self-tests: marked tests of both
world sizes (the other one skips) and unmarked tests, which run on every rank."""
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


def test_unmarked_runs_on_every_rank(record_property):
    record_property("rank", os.environ["RANK"])
    assert 0 <= int(os.environ["RANK"]) < int(os.environ["WORLD_SIZE"])


def test_unmarked_finds_no_harness_process_group():
    assert not dist.is_initialized()
