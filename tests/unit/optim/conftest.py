"""Fixtures for the optimizer / clipping unit tests: a private 1-rank gloo process group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@pytest.fixture
def one_rank_mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    """A 1-D CPU DeviceMesh over a fresh single-process gloo group, destroyed afterwards.

    A FileStore in tmp_path gives each test its own rendezvous, so nothing collides with
    other tests or with other processes on the machine.
    """
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process (torchrun mode)")
    store = dist.FileStore(str(tmp_path / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()
