"""The DTensor path on a private 1-rank process group: placeholders keep the parameters'
placements, and a load moves the parameters' version counters (engines rebuild compute weights
from that signal; DCP alone writes through ``to_local()`` and would not move them)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdp_impl import checkpoint


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh over a fresh single-process gloo group (FileStore: no port to collide on)."""
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process (torchrun mode)")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


def _sharded(seed: int, mesh: DeviceMesh) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Linear(3, 5)
    for name in ("weight", "bias"):
        value = getattr(model, name).detach()
        setattr(model, name, nn.Parameter(distribute_tensor(value, mesh, [Shard(0)])))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, scale: float) -> None:
    for p in model.parameters():
        p.grad = distribute_tensor(torch.full(p.shape, scale), p.device_mesh, p.placements)
    optimizer.step()


def test_load_keeps_placements_and_moves_version_counters(mesh: DeviceMesh, tmp_path: Path) -> None:
    src, src_opt = _sharded(0, mesh)
    _step(src, src_opt, 0.5)
    _step(src, src_opt, -0.25)
    checkpoint.save(tmp_path / "ck", src, src_opt)

    dst, dst_opt = _sharded(1, mesh)
    versions = [p._version for p in dst.parameters()]
    checkpoint.load(tmp_path / "ck", dst, dst_opt)
    assert all(p._version > v for p, v in zip(dst.parameters(), versions, strict=True)), \
        "load must look like an in-place update"
    for a, b in zip(src.parameters(), dst.parameters(), strict=True):
        assert isinstance(b, DTensor) and b.placements == a.placements
        assert torch.equal(a.full_tensor(), b.full_tensor())
        sa, sb = src_opt.state[a], dst_opt.state[b]
        assert float(sb["step"]) == 2.0 and not isinstance(sb["step"], DTensor)
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(sb[key], DTensor) and sb[key].placements == b.placements
            assert torch.equal(sa[key].full_tensor(), sb[key].full_tensor())
    _step(src, src_opt, 1.0)
    _step(dst, dst_opt, 1.0)
    pairs = zip(src.parameters(), dst.parameters(), strict=True)
    assert all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in pairs)
