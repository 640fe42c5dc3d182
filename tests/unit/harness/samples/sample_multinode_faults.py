"""Node loss (self-test sample), run as two torchrun "nodes" x 2 gloo ranks: in ``test_node_lost`` the
ranks of node 1 (GROUP_RANK 1) sleep while node 0's ranks wait for them in an all-reduce, and the
self-test kills node 1's torchrun agent and ranks. Each rank writes ``rank<r>.json`` (its pid, its
agent's pid, its node) and ``rank<r>.started`` into ``HARNESS_SELFTEST_PIDDIR``."""
import json
import os
import pathlib
import time

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.distributed(world_size=4)

NODE = int(os.environ.get("GROUP_RANK", "0"))


def _note(name: str, text: str) -> None:
    where = os.environ.get("HARNESS_SELFTEST_PIDDIR")
    if where:
        (pathlib.Path(where) / name).write_text(text)


def test_before(dist_env):
    _note(f"rank{dist_env.rank}.json", json.dumps({"pid": os.getpid(), "agent": os.getppid(), "node": NODE}))
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 4.0


def test_node_lost(dist_env):
    _note(f"rank{dist_env.rank}.started", "")
    if NODE == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_after(dist_env):
    dist.barrier()
