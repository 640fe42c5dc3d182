"""Device meshes for the mesh-shape suites (``test_mesh_*.py``, ``test_fully_shard_matrix.py``,
``test_decoupled_grad_outer.py``), and comparisons of sharded params with a reference.

Meshes follow Megatron-FSDP's test (the "seed" test) ``build_distributed_environment``: dims
``(dp_outer, dp_shard, cp, tp)`` with the flattened ``dp`` (outer x shard), ``dp_shard_cp``
(shard x cp) and ``hsdp`` (outer x shard x cp) dims. Building a mesh creates process groups (a
collective on every rank, slow on gloo with 8 ranks), so each rank process caches one mesh per
shape for the whole bucket.

Data: ranks that average their grads together (the shard group, or the hybrid group under HSDP)
each get a different sample slice, by their position in that group; replicas outside it (TP
ranks, or dp_outer ranks when dp_outer is not used) get the same data as their counterparts, so
every replica group must reproduce the single-process reference trained on the union.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_impl.device import default_device_type

from .numerics import model_relative_error, relative_error

DIMS = ("dp_outer", "dp_shard", "cp", "tp")


@functools.cache
def seed_mesh(shape: tuple[int, int, int, int], device_type: str = "cpu") -> DeviceMesh:
    """The seed's 4-D mesh with its three flattened dims (cached per rank process)."""
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=DIMS)
    mesh["dp_outer", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_outer", "dp_shard", "cp"]._flatten("hsdp")
    return mesh


def seed_kwargs(mesh: DeviceMesh, outer: str | None) -> dict[str, Any]:
    """``fully_shard`` mesh arguments exactly as the seed's ``test_fully_shard`` passes them."""
    cp = mesh["cp"].size()
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard_cp" if cp > 1 else "dp_shard",
                dp_outer_dim="dp_outer" if outer is not None else None, tp_dim="tp",
                hybrid_fsdp_group=mesh["hsdp"].get_group() if outer is not None else None,
                outer_dp_sharding_strategy=outer if outer is not None else "no_shard")


def data_group(mesh: DeviceMesh, outer: str | None) -> dist.ProcessGroup:
    """The group whose ranks average grads together (and so must see different data)."""
    if outer is not None:
        return mesh["hsdp"].get_group()
    return mesh["dp_shard_cp" if mesh["cp"].size() > 1 else "dp_shard"].get_group()


def data_position(group: dist.ProcessGroup) -> tuple[int, int]:
    """(this rank's position in ``group``, group size)."""
    ranks = dist.get_process_group_ranks(group)
    return ranks.index(dist.get_rank()), len(ranks)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 copies of the wrapped model's params (a collective over each param's mesh)."""
    return {n: p.full_tensor().detach().float().cpu().clone() for n, p in model.module.named_parameters()}


def comm_device() -> torch.device:
    """Where small check tensors must live for the default group's backend (NCCL: the GPU)."""
    return torch.device(default_device_type())


def assert_same_on_all_ranks(tensors: dict[str, torch.Tensor], what: str) -> None:
    """Every rank holds the same values (replicas across dp_outer / tp / cp must agree)."""
    names = sorted(tensors)
    flat = torch.cat([tensors[n].reshape(-1).double() for n in names]) if names else torch.zeros(1)
    flat = flat.to(comm_device())
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    spread = (hi - lo).abs().max().item()
    assert spread <= 1e-6 * max(1.0, flat.abs().max().item()), f"{what} differ across ranks by {spread:.3g}"


def _reference_local(p: Any, full: torch.Tensor) -> torch.Tensor:
    """The part of ``full`` that DTensor ``p`` holds on this rank (``Shard(0)`` = torch.chunk
    semantics, trailing ranks may be empty; ``Replicate()`` = everything)."""
    from torch.distributed.tensor import Shard

    local = full
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            n, r = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
            chunks = torch.chunk(local, n, dim=placement.dim)
            local = chunks[r] if r < len(chunks) else local.narrow(placement.dim, 0, 0)
    return local


def _local_pairs(model: torch.nn.Module, expected: dict[str, torch.Tensor], grads: bool
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this rank's local shards, the same part of ``expected``, the full expected tensors) by
    name, for every param with a value (``grads``: a grad); the names must be ``expected``'s."""
    local, ref_local, full = {}, {}, {}
    for n, p in model.module.named_parameters():
        t = p.grad if grads else p
        if t is None:
            assert n not in expected, f"{n}: no {'grad' if grads else 'value'} but the reference has one"
            continue
        assert n in expected, f"{n}: not in the reference"
        full[n] = expected[n].double()
        local[n], ref_local[n] = t.to_local().detach().double().cpu(), _reference_local(p, full[n])
    return local, ref_local, full


def _max_over_ranks(value: float) -> float:
    agreed = torch.tensor([value], dtype=torch.float64, device=comm_device())
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    return agreed.item()


def sharded_max_error(model: torch.nn.Module, expected: dict[str, torch.Tensor], grads: bool = False
                      ) -> tuple[float, str]:
    """Largest per-tensor ``||local - expected_local|| / ||expected||`` over all ranks, comparing
    each rank's local shards only (one all-reduce instead of one all-gather per param); the name
    is this rank's worst."""
    local, ref_local, full = _local_pairs(model, expected, grads)
    assert local.keys() == expected.keys(), f"names differ: {sorted(local.keys() ^ expected.keys())}"
    worst, where = 0.0, ""
    for n in local:
        err = relative_error(local[n], ref_local[n], scale=full[n])
        if err > worst:
            worst, where = err, n
    return _max_over_ranks(worst), where


def _gather_dim(p: Any) -> int | None:
    """The one mesh dim a param is ``Shard(0)`` on when all others are ``Replicate()`` (-1: all
    replicated; None: another layout, e.g. tensor-parallel, gathered with ``full_tensor``)."""
    from torch.distributed.tensor import Replicate, Shard

    shard = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if not shard:
        return -1
    if len(shard) == 1 and type(p.placements[shard[0]]) is Shard and p.placements[shard[0]].dim == 0:
        return shard[0]
    return None


def gathered_full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Like ``full_params`` but with one ``all_gather_object`` per (mesh, shard dim) instead of
    one all-gather per param (8 ranks on 2 loaded cores pay per collective). ``Shard(0)`` shards
    follow torch.chunk semantics, so concatenating them in mesh-rank order gives the full tensor;
    HSDP's ``[Replicate(), Shard(0)]`` params gather over their shard dim only."""
    params = list(model.module.named_parameters())
    keys: list[tuple[Any, int | None]] = []
    for _, p in params:
        key = (p.device_mesh, _gather_dim(p))
        if key[1] is not None and all(k[0] is not key[0] or k[1] != key[1] for k in keys):
            keys.append(key)
    out: dict[str, torch.Tensor] = {n: p.full_tensor().detach().float().cpu()
                                    for n, p in params if _gather_dim(p) is None}
    for mesh, dim in keys:
        mine = [(n, p) for n, p in params if p.device_mesh is mesh and _gather_dim(p) == dim]
        if dim == -1:
            out.update({n: p.to_local().detach().float().cpu() for n, p in mine})
            continue
        payload = (mesh.get_local_rank(dim), {n: p.to_local().detach().float().cpu() for n, p in mine})
        objs: list[Any] = [None] * mesh.size(dim)
        dist.all_gather_object(objs, payload, group=mesh.get_group(dim))
        ordered = [o[1] for o in sorted(objs, key=lambda o: o[0])]
        for n, _ in mine:
            out[n] = torch.cat([o[n] for o in ordered], dim=0)
    for n, p in params:
        assert tuple(out[n].shape) == tuple(p.shape), f"{n}: gathered {tuple(out[n].shape)} vs {tuple(p.shape)}"
    return out


def sharded_model_error(model: torch.nn.Module, expected: dict[str, torch.Tensor], grads: bool = False) -> float:
    """Whole-model ``||local diffs|| / ||expected||`` (all params together, see
    ``model_relative_error``), max over ranks."""
    local, ref_local, full = _local_pairs(model, expected, grads)
    return _max_over_ranks(model_relative_error(local, ref_local, scale=full))
