"""Run by the self-tests as two torchrun "nodes" x 2 gloo ranks (``torchrun --nnodes 2`` twice, c10d
on 127.0.0.1): node 1 (torchrun's GROUP_RANK 1) holds ranks 2 and 3. ``HARNESS_SELFTEST_SLOW_S``:
how long rank 3 sleeps in ``test_slow_rank_on_node1`` (longer than the heartbeat timeout the
self-test gives, so only its heartbeats keep it from being declared lost)."""
import os
import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=4)

NODE = int(os.environ.get("GROUP_RANK", "0"))
LOCAL = int(os.environ.get("LOCAL_RANK", "0"))
SLOW_S = float(os.environ.get("HARNESS_SELFTEST_SLOW_S", "0"))


def test_before(dist_env):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4.0


def test_fails_on_one_rank_of_node1(dist_env):
    """Rank 3 (node 1, local rank 1) prints more than the report keeps, then fails."""
    dist.barrier()
    if (NODE, LOCAL) == (1, 1):
        print("x" * 300_000)
        assert dist_env.rank == -1, "node one, local rank one disagrees"


def test_slow_rank_on_node1(dist_env):
    if (NODE, LOCAL) == (1, 1):
        time.sleep(SLOW_S)
    dist.barrier()


def test_after(dist_env):
    dist.barrier()
