"""Mesh shapes beyond one shard dim: HSDP, HFSDP, TP and CP (issue 4).

``resolve_parallel_dims`` turns the user's mesh arguments into a ``ParallelDims``: which mesh the
FSDP units shard over, which group (if any) grads are all-reduced across once per optimisation
cycle, and the groups ``model.dist_index`` reports. It runs before anything is allocated, so every
bad combination fails early with a message naming the argument and the allowed values.

Designs (correct and simple first):

* **HSDP** (``outer_dp_sharding_strategy='no_shard'``/0): units shard over ``dp_shard_dim``
  exactly as plain FSDP; every ``dp_outer`` replica holds the same shards. The sync backward
  (and only it) all-reduces (AVG) each unit's main-grad shard across the ``dp_outer`` group
  before the grads are installed (``OuterGradReducer``), so the outer traffic is once per
  optimisation cycle, however many microbatches accumulated. AVG is linear, so reducing the
  accumulated sum once equals reducing every microbatch.
* **HFSDP** (``'optim'``/1, inner ``'optim_grads_params'``/3 only): main params, grads and
  optimizer state are sharded over the whole hybrid group (``hybrid_fsdp_group``, i.e.
  dp_outer x dp_shard[x cp]): the units' shard mesh *is* the hybrid group, so all-gathers and
  reduce-scatters run over it. The outer dim's traffic therefore happens on every microbatch
  (no separate outer step); a two-level schedule (inner every microbatch, outer once) is a
  later optimisation.
* **TP** (``tp_dim`` of size > 1): a plain model (no DTensor params) is replicated over TP; TP
  ranks see the same data, so their grads are already equal and data-parallel semantics are
  unchanged. DTensor tensor-parallel params (``parallelize_module``) are not composed yet.
* **CP**: pass a flattened dp_shard x cp dim as ``dp_shard_dim``; grads of the cp ranks (which
  saw different sequence chunks of the same samples) are then averaged together with the
  data-parallel ones by the ordinary shard-group reduction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from . import comm
from .mesh import submesh
from .policy import ShardingStrategy

ISSUE = "issue 4: HSDP/TP"


@dataclass
class ParallelDims:
    """The resolved groups of one wrapped model (``None`` where a parallelism is not in use)."""

    mesh: DeviceMesh
    inner_mesh: DeviceMesh  # the dp_shard_dim sub-mesh (the "fsdp group")
    shard_mesh: DeviceMesh  # what the units shard over: inner_mesh, or the hybrid group (HFSDP)
    outer_group: Optional[dist.ProcessGroup] = None
    hybrid_group: Optional[dist.ProcessGroup] = None
    tp_group: Optional[dist.ProcessGroup] = None
    outer_reduce: bool = False  # HSDP: all-reduce grads across outer_group on the sync backward


def _ranks(group: dist.ProcessGroup) -> List[int]:
    return sorted(dist.get_process_group_ranks(group))


def _check_pairing(dp_outer_dim: Optional[str], hybrid_fsdp_group: object, outer: ShardingStrategy) -> None:
    if (dp_outer_dim is None) != (hybrid_fsdp_group is None):
        given, missing = (("dp_outer_dim", "hybrid_fsdp_group") if dp_outer_dim is not None
                          else ("hybrid_fsdp_group", "dp_outer_dim"))
        raise ValueError(f"{given} was given without {missing}; HSDP needs both (dp_outer_dim names "
                         "the replica dim of the mesh, hybrid_fsdp_group is the process group over "
                         "dp_outer x dp_shard_dim), or neither for plain FSDP")
    if outer == ShardingStrategy.OPTIM and dp_outer_dim is None:
        raise ValueError("outer_dp_sharding_strategy='optim'/1 needs dp_outer_dim and "
                         "hybrid_fsdp_group; without them the only allowed value is 'no_shard'/0")
    if hybrid_fsdp_group is not None and not isinstance(hybrid_fsdp_group, dist.ProcessGroup):
        raise TypeError("hybrid_fsdp_group must be a torch.distributed.ProcessGroup (e.g. "
                        f"device_mesh['hsdp'].get_group()), got {type(hybrid_fsdp_group).__name__}")


def _check_hybrid_group(inner: DeviceMesh, outer: DeviceMesh, hybrid: dist.ProcessGroup,
                        dp_shard_dim: str, dp_outer_dim: str) -> None:
    """The hybrid group must be exactly this rank's dp_outer x dp_shard_dim block."""
    expected = inner.size() * outer.size()
    if hybrid.size() != expected:
        raise ValueError(f"hybrid_fsdp_group has {hybrid.size()} ranks but dp_outer_dim={dp_outer_dim!r} "
                         f"(size {outer.size()}) x dp_shard_dim={dp_shard_dim!r} (size {inner.size()}) "
                         f"has {expected}; pass the group of the flattened dp_outer x dp_shard_dim dim")
    members = set(_ranks(hybrid))
    missing = [r for r in _ranks(inner.get_group()) + _ranks(outer.get_group()) if r not in members]
    if missing:
        raise ValueError(f"hybrid_fsdp_group does not contain ranks {missing} of this rank's "
                         f"dp_shard_dim={dp_shard_dim!r} / dp_outer_dim={dp_outer_dim!r} groups; pass "
                         "the group of the flattened dp_outer x dp_shard_dim dim")


def resolve_parallel_dims(mesh: DeviceMesh, inner_mesh: DeviceMesh, dp_shard_dim: Optional[str],
                          dp_outer_dim: Optional[str], tp_dim: Optional[str], hybrid_fsdp_group: object,
                          strategy: ShardingStrategy, outer: ShardingStrategy) -> ParallelDims:
    """Validate the HSDP/TP arguments and pick the groups (no collective is issued here)."""
    _check_pairing(dp_outer_dim, hybrid_fsdp_group, outer)
    if outer == ShardingStrategy.OPTIM and strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(f"outer_dp_sharding_strategy='optim'/1 requires zero_dp_strategy="
                         f"'optim_grads_params'/3, got zero_dp_strategy={strategy.name.lower()!r}/{int(strategy)}")
    dims = ParallelDims(mesh=mesh, inner_mesh=inner_mesh, shard_mesh=inner_mesh)
    if tp_dim is not None:
        tp_mesh = submesh(mesh, tp_dim, "tp_dim")
        if tp_dim == dp_shard_dim or tp_dim == dp_outer_dim:
            raise ValueError(f"tp_dim={tp_dim!r} must differ from dp_shard_dim and dp_outer_dim")
        if tp_mesh.size() > 1:
            dims.tp_group = tp_mesh.get_group()
    if dp_outer_dim is None:
        return dims
    if dp_outer_dim == dp_shard_dim:
        raise ValueError(f"dp_outer_dim={dp_outer_dim!r} must differ from dp_shard_dim={dp_shard_dim!r}")
    outer_mesh = submesh(mesh, dp_outer_dim, "dp_outer_dim")
    _check_hybrid_group(inner_mesh, outer_mesh, hybrid_fsdp_group, str(dp_shard_dim), dp_outer_dim)
    dims.outer_group = outer_mesh.get_group()
    dims.hybrid_group = hybrid_fsdp_group
    if outer == ShardingStrategy.OPTIM:
        dims.shard_mesh = DeviceMesh.from_group(hybrid_fsdp_group, mesh.device_type,
                                                mesh_dim_names=("hsdp",))
    else:
        dims.outer_reduce = outer_mesh.size() > 1
    return dims


def check_tp_params(module: nn.Module, dims: ParallelDims) -> None:
    """DTensor (tensor-parallel) params are not composed with FSDP sharding yet: fail loudly."""
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            raise NotImplementedError(
                f"parameter {name!r} is a DTensor on mesh dims {p.device_mesh.mesh_dim_names} "
                f"(placements {p.placements}); composing tensor-parallel DTensor params with FSDP "
                f"sharding is not implemented yet ({ISSUE}); plain (TP-replicated) modules work "
                "with a tp_dim of any size")


class OuterGradReducer:
    """HSDP: averages every unit's main-grad shard across the dp_outer replicas, once per
    optimisation cycle (called by the engine on the sync backward, before grads are installed)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def reduce(self, grad_buffers: List[object]) -> None:
        """``grad_buffers``: the units' ``DataParallelBuffer``s (``None`` for frozen-only units),
        in the engine's unit order, identical on every rank."""
        for buf in grad_buffers:
            if buf is None or not buf.data.numel():
                continue
            ensure = getattr(buf, "ensure_allocated", None)  # zero_grad(set_to_none) may free it
            if ensure is not None:
                ensure()
            comm.all_reduce_avg(buf.data, self.group)
