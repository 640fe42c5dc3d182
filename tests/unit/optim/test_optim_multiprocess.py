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
from torch.utils._python_dispatch import TorchDispatchMode

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


# (class, kwargs) stepped on local shards and on DTensors; foreach=True forces the multi-tensor
# path on CPU (torch's default there is the per-tensor loop), so both of torch's paths are covered.
_LOCAL_STEP_CASES: list[tuple[type[torch.optim.Optimizer], dict[str, Any]]] = [
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "foreach": True, "amsgrad": True}),
    (torch.optim.Adam, {"lr": 0.01, "foreach": True}),
    (torch.optim.Adam, {"lr": 0.01, "fused": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "foreach": True}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True, "foreach": True}),
    (torch.optim.Adamax, {"lr": 0.01, "foreach": True}),
    (torch.optim.NAdam, {"lr": 0.01, "foreach": True}),
    (torch.optim.RAdam, {"lr": 0.01, "foreach": True}),
]


def _dtensor_params(start: list[torch.Tensor], layouts: list[tuple[Any, list[Any]]]) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(distribute_tensor(t.clone(), m, pl)) for t, (m, pl) in zip(start, layouts, strict=True)]


def _local_step_worker(rank: int, store_path: str) -> None:
    """Each elementwise optimizer stepped by ``LocalShardStep`` equals the same optimizer stepped
    on DTensors bit for bit (params and every state entry), its state stays DTensor-shaped with
    the param's placements, and the DTensor dispatch really is skipped (no DTensor op runs)."""
    from fsdp_impl.local_step import LocalShardStep, eligible_class

    world_mesh, mesh_2d = _setup(rank, store_path)
    layouts = _layouts(world_mesh, mesh_2d)
    for cls, kwargs in _LOCAL_STEP_CASES:
        assert eligible_class(cls)
        start = _full_grads(seed=1)
        params, ref = _dtensor_params(start, layouts), _dtensor_params(start, layouts)
        opt, ref_opt = cls(params, **kwargs), cls(ref, **kwargs)
        local = LocalShardStep()
        for step in range(3):
            for p, r, g, (m, pl) in zip(params, ref, _full_grads(seed=100 + step), layouts, strict=True):
                p.grad = distribute_tensor(g, m, pl)
                r.grad = distribute_tensor(g, m, pl)
            params[1].grad = None if step == 1 else params[1].grad  # a param without grad this step
            ref[1].grad = None if step == 1 else ref[1].grad
            with _no_dtensor_dispatch():
                local.run(opt, opt.step)
            ref_opt.step()
        for p, r in zip(params, ref, strict=True):
            assert torch.equal(p._local_tensor, r._local_tensor), (cls.__name__, kwargs)
            assert p.grad is None or isinstance(p.grad, DTensor)
            assert opt.state[p].keys() == ref_opt.state[r].keys()
            for key, value in ref_opt.state[r].items():
                mine = opt.state[p][key]
                assert type(mine) is type(value), (cls.__name__, key, type(mine), type(value))
                if isinstance(value, DTensor):
                    assert mine.placements == value.placements and mine.shape == value.shape
                    assert torch.equal(mine._local_tensor, value._local_tensor), (cls.__name__, key)
                elif isinstance(value, torch.Tensor):
                    assert torch.equal(mine, value), (cls.__name__, key)
        assert opt.state_dict()["param_groups"] == ref_opt.state_dict()["param_groups"]
    _partial_grad_falls_back(world_mesh)
    _step_hooks_see_dtensors(world_mesh)
    dist.destroy_process_group()


def _step_hooks_see_dtensors(mesh: Any) -> None:
    """A step pre-hook runs inside ``step``: with one registered, the params it sees in the groups
    are still the DTensors (a hook computing e.g. a norm over them gets the global one)."""
    from fsdp_impl.local_step import LocalShardStep

    p = torch.nn.Parameter(distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]))
    p.grad = distribute_tensor(torch.ones(8), mesh, [Shard(0)])
    opt = torch.optim.SGD([p], lr=0.5)
    seen: list[type] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.extend(type(q) for g in o.param_groups for q in g["params"]))
    LocalShardStep().run(opt, opt.step)
    assert seen == [DTensor], seen
    assert torch.equal(p.full_tensor(), torch.arange(8.0) - 0.5)


def _partial_grad_falls_back(mesh: Any) -> None:
    """A grad whose placements are not its param's (``Partial``: the local tensor is a summand,
    not the shard) must not be stepped locally: the result equals the DTensor step."""
    from torch.distributed.tensor import Partial

    from fsdp_impl.local_step import LocalShardStep

    full = torch.arange(8.0)
    p = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Replicate()]))
    r = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Replicate()]))
    for q in (p, r):
        q.grad = DTensor.from_local(torch.ones(8), mesh, [Partial()], run_check=False)
    opt, ref_opt = torch.optim.SGD([p], lr=0.5), torch.optim.SGD([r], lr=0.5)
    LocalShardStep().run(opt, opt.step)
    ref_opt.step()
    assert torch.equal(p._local_tensor, r._local_tensor)
    assert torch.equal(p._local_tensor, full - 0.5 * WORLD)  # the reduced grad, not the local summand


class _no_dtensor_dispatch(TorchDispatchMode):
    """Fails the test if any aten op inside gets a DTensor argument (a dispatch mode sees each op
    with its original arguments, before DTensor's own dispatch, Python or C++ fast path)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        flat = torch.utils._pytree.tree_leaves((args, kwargs or {}))
        if any(isinstance(t, DTensor) for t in flat):
            raise AssertionError(f"DTensor dispatch of {func} inside the local-shard step")
        return func(*args, **(kwargs or {}))


def test_local_shard_step_bit_identical_to_dtensor_step(tmp_path: Path) -> None:
    _spawn(_local_step_worker, tmp_path)
