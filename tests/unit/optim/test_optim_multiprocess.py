"""Clipping and Adam on DTensors really sharded over 4 gloo ranks (uneven and empty shards).

These do not need the FSDP engine or the harness: each test spawns its own 4 CPU processes
with a FileStore rendezvous in tmp_path, builds sharded DTensors with ``distribute_tensor``
(torch.chunk semantics, so trailing ranks hold empty shards), and compares with the same
computation on full tensors in each process (torch.nn.utils.clip_grad_norm_, torch.optim.AdamW).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from fsdp_impl.clip_grad import clip_grad_norm
from fsdp_impl.optim import AdamW

WORLD = 4
TIMEOUT_S = 240.0
# Global shapes: (2, 3) leaves ranks 2 and 3 empty; (1,) leaves ranks 1-3 empty; (9,) is uneven.
SHAPES = [(2, 3), (9,), (1,), (6, 2)]


def _full_grads(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def _layouts(world_mesh: Any, mesh_2d: Any) -> list[tuple[Any, list[Any]]]:
    """A mix of meshes/placements, so grouping and per-dim reductions are all exercised."""
    return [
        (world_mesh, [Shard(0)]),
        (mesh_2d, [Replicate(), Shard(0)]),
        (world_mesh, [Shard(0)]),
        (mesh_2d, [Shard(0), Replicate()]),
    ]


def _clip_worker(rank: int, store_path: str) -> None:
    world_mesh, mesh_2d = _setup(rank, store_path)
    for norm_type in (2.0, 1.0, math.inf):
        full = _full_grads(seed=7)
        params = []
        for g, (mesh, placements) in zip(full, _layouts(world_mesh, mesh_2d), strict=True):
            p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, placements))
            p.decoupled_grad = distribute_tensor(g, mesh, placements)
            params.append(p)
        assert params[2].decoupled_grad.to_local().numel() == (1 if rank == 0 else 0)
        ref = [torch.nn.Parameter(torch.zeros_like(g)) for g in full]
        for r, g in zip(ref, full, strict=True):
            r.grad = g.clone()
        total = clip_grad_norm(params, 0.3, norm_type, use_decoupled_grad=True)
        ref_total = torch.nn.utils.clip_grad_norm_(ref, 0.3, norm_type)
        torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0, msg=f"norm {norm_type}")
        for p, r in zip(params, ref, strict=True):
            torch.testing.assert_close(p.decoupled_grad.full_tensor(), r.grad, rtol=1e-6, atol=1e-7)
    dist.destroy_process_group()


def _adam_worker(rank: int, store_path: str) -> None:
    world_mesh, mesh_2d = _setup(rank, store_path)
    start = _full_grads(seed=1)
    layouts = _layouts(world_mesh, mesh_2d)
    params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), m, pl)) for t, (m, pl) in zip(start, layouts, strict=True)
    ]
    ref = [torch.nn.Parameter(t.clone()) for t in start]
    opt = AdamW(params, lr=0.01, weight_decay=0.1, use_decoupled_grad=True)
    ref_opt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.1)
    for step in range(4):
        grads = _full_grads(seed=100 + step)
        for p, r, g, (m, pl) in zip(params, ref, grads, layouts, strict=True):
            p.decoupled_grad = distribute_tensor(g, m, pl)
            r.grad = g.clone()
        clip_grad_norm(params, 1.0, use_decoupled_grad=True)
        torch.nn.utils.clip_grad_norm_(ref, 1.0)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        assert all(p.decoupled_grad is None for p in params)
    for p, r in zip(params, ref, strict=True):
        torch.testing.assert_close(p.full_tensor(), r.detach(), rtol=1e-6, atol=1e-7)
    for p in params:  # state exists (and is DTensor) even where the local shard is empty
        assert isinstance(opt.state[p]["exp_avg"], DTensor)
        assert opt.state[p]["step"].item() == 4
    dist.destroy_process_group()


def _setup(rank: int, store_path: str) -> tuple[Any, Any]:
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD)
    world_mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp_shard",))
    mesh_2d = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp_outer", "dp_inner"))
    return world_mesh, mesh_2d


def _spawn(worker: Callable[[int, str], None], tmp_path: Path) -> None:
    """Run ``worker`` on WORLD processes; fail (and reap them) on error or after TIMEOUT_S."""
    context = mp.start_processes(
        worker, args=(str(tmp_path / "store"),), nprocs=WORLD, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                pytest.fail(f"{worker.__name__} did not finish within {TIMEOUT_S}s (hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def test_clip_grad_norm_sharded_uneven(tmp_path: Path) -> None:
    _spawn(_clip_worker, tmp_path)


def test_adamw_decoupled_sharded_matches_full(tmp_path: Path) -> None:
    _spawn(_adam_worker, tmp_path)
