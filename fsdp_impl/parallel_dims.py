"""Resolve the parallel dims of a wrap: plain FSDP, HSDP, HFSDP, TP and CP.

``resolve_parallel_dims`` turns the user's mesh arguments into a ``ParallelDims``: which mesh the
FSDP units shard over, which group (if any) grads are all-reduced across once per optimisation
cycle, and the groups ``model.dist_index`` reports. It runs before anything is allocated, so every
bad combination fails early with a message naming the argument and the allowed values.

Designs (correct and simple first):

* **HSDP** (``outer_dp_sharding_strategy='no_shard'``/0): units shard over ``dp_shard_dim``
  exactly as plain FSDP; every ``dp_outer`` replica holds the same shards. The sync backward
  (and only it) all-reduces (AVG) each unit's main-grad shard across the ``dp_outer`` group
  before the grads are installed (``fsdp_impl.grad_reduce.OuterGradReducer``), so the outer traffic is once per
  optimisation cycle, however many microbatches accumulated. AVG is linear, so reducing the
  accumulated sum once equals reducing every microbatch.
* **HFSDP** (``'optim'``/1, inner ``'optim_grads_params'``/3 only): main params, grads and
  optimizer state are sharded over the whole hybrid group (``hybrid_fsdp_group``, i.e.
  dp_outer x dp_shard[x cp]): the units' shard mesh *is* the hybrid group, so the param
  all-gathers run over it on every forward/backward. Grads take two levels
  (``fsdp_impl.grad_reduce.TwoLevelReduceScatter``): a reduce-scatter inside dp_shard every
  backward, accumulated, and one across dp_outer on the sync backward, so grad traffic crosses
  dp_outer once per cycle. That needs hybrid rank = outer rank x inner size + inner rank (e.g. a
  flattened ``hsdp`` dim of ``(dp_outer, dp_shard[, cp])``); any other rank order keeps one
  reduce-scatter over the hybrid group per backward.
* **TP** (``tp_dim`` of size > 1): a plain model (no DTensor params) is replicated over TP; TP
  ranks see the same data, so their grads are already equal and data-parallel semantics are
  unchanged. DTensor tensor-parallel params (``parallelize_module`` on the tp sub-mesh) are
  sharded by rows of their TP-local tensor; the compute params are TP DTensors again, the
  sharded params DTensors over (dp dims..., tp) (``fsdp_impl.placement``).
* **CP**: pass a flattened dp_shard x cp dim as ``dp_shard_dim``; grads of the cp ranks (which
  saw different sequence chunks of the same samples) are then averaged together with the
  data-parallel ones by the ordinary shard-group reduction.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .mesh import MeshDim, submesh
from .param import ManagedParam
from .placement import PlacementPlan, find_flattened_dim, tp_spec_of
from .policy import ShardingStrategy


@dataclass
class ParallelDims:
    """The resolved groups of one wrapped model (``None`` where a parallelism is not in use)."""

    mesh: DeviceMesh
    inner_mesh: DeviceMesh  # the dp_shard_dim sub-mesh (the "fsdp group")
    shard_mesh: DeviceMesh  # what the units shard over: inner_mesh, or the hybrid group (HFSDP)
    plan: PlacementPlan  # meshes/placements of the sharded DTensors
    outer_group: dist.ProcessGroup | None = None
    hybrid_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    hsdp_reduce_group: dist.ProcessGroup | None = None  # HSDP: grads all-reduced across it on sync
    shard_group: dist.ProcessGroup | None = None  # collectives of the units (None: shard_mesh's)
    tp_mesh: DeviceMesh | None = None
    tp_dim: str | None = None


def _ranks(group: dist.ProcessGroup) -> list[int]:
    return sorted(dist.get_process_group_ranks(group))


def _check_pairing(dp_outer_dim: str | None, hybrid_fsdp_group: object, outer: ShardingStrategy,
                   group_arg: str = "hybrid_fsdp_group") -> dist.ProcessGroup | None:
    """Check that HSDP's two arguments come together; returns the (type-checked) group.
    ``group_arg`` names the group argument in messages (the expert mesh's is another one)."""
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        given, missing = (("dp_outer_dim", group_arg) if dp_outer_dim is not None
                          else (group_arg, "dp_outer_dim"))
        raise ValueError(f"{given} was given without {missing}; HSDP needs both (dp_outer_dim names "
                         f"the replica dim of the mesh, {group_arg} is the process group over "
                         "dp_outer x dp_shard_dim), or neither for plain FSDP")
    if outer == ShardingStrategy.OPTIM and dp_outer_dim is None:
        raise ValueError("outer_dp_sharding_strategy='optim'/1 needs dp_outer_dim and "
                         f"{group_arg}; without them the only allowed value is 'no_shard'/0")
    if hybrid_fsdp_group is not None and not isinstance(hybrid_fsdp_group, dist.ProcessGroup):
        raise TypeError(f"{group_arg} must be a torch.distributed.ProcessGroup (e.g. "
                        f"device_mesh[{MeshDim.HSDP.value!r}].get_group()), got "
                        f"{type(hybrid_fsdp_group).__name__}")
    return hybrid_fsdp_group


def _check_hybrid_group(inner: DeviceMesh, outer: DeviceMesh, hybrid: dist.ProcessGroup,
                        dp_shard_dim: str, dp_outer_dim: str, group_arg: str) -> None:
    """The hybrid group must be exactly this rank's dp_outer x dp_shard_dim block."""
    expected = inner.size() * outer.size()
    if hybrid.size() != expected:
        raise ValueError(f"{group_arg} has {hybrid.size()} ranks but dp_outer_dim={dp_outer_dim!r} "
                         f"(size {outer.size()}) x dp_shard_dim={dp_shard_dim!r} (size {inner.size()}) "
                         f"has {expected}; pass the group of the flattened dp_outer x dp_shard_dim dim")
    members = set(_ranks(hybrid))
    missing = [r for r in _ranks(inner.get_group()) + _ranks(outer.get_group()) if r not in members]
    if missing:
        raise ValueError(f"{group_arg} does not contain ranks {missing} of this rank's "
                         f"dp_shard_dim={dp_shard_dim!r} / dp_outer_dim={dp_outer_dim!r} groups; pass "
                         "the group of the flattened dp_outer x dp_shard_dim dim")


def resolve_parallel_dims(mesh: DeviceMesh, inner_mesh: DeviceMesh, dp_shard_dim: str | None,
                          dp_outer_dim: str | None, tp_dim: str | None, hybrid_fsdp_group: object,
                          strategy: ShardingStrategy, outer: ShardingStrategy,
                          group_arg: str = "hybrid_fsdp_group") -> ParallelDims:
    """Validate the HSDP/TP arguments and pick the groups (no collective is issued here).

    The strategy pairing (outer ``'optim'``/1 needs inner ``'optim_grads_params'``/3) is
    checked by the caller, with the other argument checks. ``group_arg`` names
    ``hybrid_fsdp_group`` in messages (``hybrid_fsdp_expt_group`` for the expert mesh)."""
    hybrid = _check_pairing(dp_outer_dim, hybrid_fsdp_group, outer, group_arg)
    tp_mesh, tp_group = None, None
    if tp_dim is not None:
        tp_mesh = submesh(mesh, tp_dim, "tp_dim")
        if tp_dim == dp_shard_dim or tp_dim == dp_outer_dim:
            raise ValueError(f"tp_dim={tp_dim!r} must differ from dp_shard_dim and dp_outer_dim")
        if tp_mesh.size() > 1:
            tp_group = tp_mesh.get_group()
    sharded = strategy != ShardingStrategy.NO_SHARD
    inner_names = (dp_shard_dim,) if dp_shard_dim is not None else _own_names(mesh)
    dims = ParallelDims(mesh=mesh, inner_mesh=inner_mesh, shard_mesh=inner_mesh,
                        plan=PlacementPlan(mesh, inner_mesh, inner_names, False, sharded, tp_dim),
                        tp_group=tp_group, tp_mesh=tp_mesh, tp_dim=tp_dim)
    if dp_outer_dim is None:
        return dims
    assert hybrid is not None  # _check_pairing: dp_outer_dim and hybrid_fsdp_group come together
    if dp_outer_dim == dp_shard_dim:
        raise ValueError(f"dp_outer_dim={dp_outer_dim!r} must differ from dp_shard_dim={dp_shard_dim!r}")
    outer_mesh = submesh(mesh, dp_outer_dim, "dp_outer_dim")
    _check_hybrid_group(inner_mesh, outer_mesh, hybrid, str(dp_shard_dim), dp_outer_dim, group_arg)
    dims.outer_group = outer_mesh.get_group()
    dims.hybrid_group = hybrid
    if outer == ShardingStrategy.OPTIM:
        dims.shard_mesh, names = _hybrid_mesh(mesh, hybrid)
        dims.shard_group = hybrid
        dims.plan = PlacementPlan(mesh, dims.shard_mesh, names, False, sharded, tp_dim)
    else:
        if outer_mesh.size() > 1:
            dims.hsdp_reduce_group = dims.outer_group
        dims.plan = _hsdp_plan(mesh, dims.plan, (dp_outer_dim, str(dp_shard_dim)), sharded, tp_dim)
    return dims


def _ordered_ranks(group: dist.ProcessGroup) -> list[int]:
    """Global ranks in group-rank order (what an all-gather's output order follows)."""
    return sorted(dist.get_process_group_ranks(group), key=lambda r: dist.get_group_rank(group, r))


def check_gather_group(gather_group: object, dims: ParallelDims, arg: str) -> None:
    """``fsdp_group_ag`` / ``expt_fsdp_group_ag``: a second communicator over exactly the ranks,
    in the same order, that the units' params are gathered over (so the all-gathers can overlap
    the grad reductions on the other one)."""
    if gather_group is None:
        return
    member = gather_group is not dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives non-members
    if member and not isinstance(gather_group, dist.ProcessGroup):
        raise TypeError(f"{arg} must be a torch.distributed.ProcessGroup or None, got {type(gather_group).__name__}")
    shard_group = dims.shard_group or dims.shard_mesh.get_group()
    expected = _ordered_ranks(shard_group)
    got = _ordered_ranks(gather_group) if member else []  # type: ignore[arg-type]
    if got != expected:
        raise ValueError(f"{arg} must hold the same ranks, in the same order, as the group the params are "
                         f"gathered over ({expected} on this rank); got {got or 'a group without this rank'}")


def _own_names(mesh: DeviceMesh) -> tuple[str, ...] | None:
    names = mesh.mesh_dim_names
    return tuple(names) if names and mesh.ndim == 1 else None


def _hybrid_mesh(mesh: DeviceMesh, hybrid: dist.ProcessGroup) -> tuple[DeviceMesh, tuple[str, ...] | None]:
    """HFSDP's shard mesh: the flattened dim of ``mesh`` that is the hybrid group when there is
    one whose local rank is the group rank (then TP params can join it), else a mesh built
    from the bare group."""
    name = find_flattened_dim(mesh, hybrid)
    if name is not None and mesh[name].get_local_rank() == dist.get_rank(hybrid):
        return mesh[name], (name,)
    return DeviceMesh.from_group(hybrid, mesh.device_type, mesh_dim_names=(MeshDim.HSDP.value,)), None


def _hsdp_plan(mesh: DeviceMesh, fallback: PlacementPlan, names: tuple[str, str], sharded: bool,
               tp_dim: str | None) -> PlacementPlan:
    """HSDP params are ``[Replicate(), Shard(0)]`` over ``(dp_outer, dp_shard)``; a mesh whose
    dims cannot be sliced in that order keeps the 1-D inner-mesh description."""
    try:
        dp_mesh = mesh[names]
    except (KeyError, RuntimeError, ValueError):
        return fallback
    return PlacementPlan(mesh, dp_mesh, names, True, sharded, tp_dim)


def attach_tp_specs(groups: list[list[ManagedParam]], dims: ParallelDims) -> None:
    """Record which params are tensor-parallel DTensors (checked here, before any allocation);
    their TP-local shape is what the units lay out and shard."""
    specs = []
    for group in groups:
        for p in group:
            p.set_tp(tp_spec_of(p.fqn, p.orig, dims.tp_mesh, dims.tp_dim))
            specs.append(p.tp)
    dims.plan.check(specs)

