"""Expert parallelism: which params are expert params, and the groups they shard over.

With expert parallelism (EP) each rank holds only its EP rank's experts, so an expert param is
replicated across the *expert*-data-parallel ranks (those with the same EP rank), not across
the whole data-parallel group. Megatron-FSDP's ``expt_device_mesh`` describes them: expert params
shard over ``expt_device_mesh[dp_shard_dim]`` (with HSDP, replicate across
``expt_device_mesh[dp_outer_dim]``, or shard over ``hybrid_fsdp_expt_group`` with HFSDP), every
other param over the ordinary groups. Units whose params include both are split in two units
(one per group), gathered and reduced together around the same module.

Which params are expert params follows Megatron-FSDP 0.6.1: a name with an ``.experts.``
segment (Megatron-Core keeps the experts of an MoE layer in ``...mlp.experts``), and also a
param marked ``allreduce=False`` (how Megatron-Core marks expert params; Megatron-FSDP requires
an expert group when it sees one). Without ``expt_device_mesh``, ``.experts.`` params are
ordinary data-parallel params (experts replicated on every rank), while ``allreduce=False``
params are an error, as in Megatron-FSDP.

Grads: an expert's grad on one rank already holds what every EP peer's tokens contributed (the
tokens were dispatched to it), so summing over the expert-data-parallel group covers the whole
data-parallel batch; the division is by the whole data-parallel size (``GradScaling.for_units``).
"""
from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .mesh import mesh_dim_names
from .parallel_dims import ParallelDims, resolve_parallel_dims
from .param import ManagedParam
from .policy import ShardingStrategy


def is_expert_param(fqn: str, param: nn.Parameter) -> bool:
    """An ``.experts.`` name segment, or ``allreduce=False`` (see the module docstring)."""
    return ".experts." in f".{fqn}" or getattr(param, "allreduce", True) is False


def _check_group(value: object, arg: str) -> None:
    if value is not None and not isinstance(value, dist.ProcessGroup):
        raise TypeError(f"{arg} must be a torch.distributed.ProcessGroup or None, got {type(value).__name__}")


def resolve_expert_dims(module: nn.Module, expt_mesh: object, dp_shard_dim: str, dp_outer_dim: str | None,
                        tp_dim: str | None, hybrid_expt_group: object, expt_group_ag: object,
                        strategy: ShardingStrategy, outer: ShardingStrategy) -> ParallelDims | None:
    """The expert params' groups, or ``None`` without ``expt_device_mesh`` (after checking the
    model has no ``allreduce=False`` param and no other expert argument was given)."""
    _check_group(hybrid_expt_group, "hybrid_fsdp_expt_group")
    _check_group(expt_group_ag, "expt_fsdp_group_ag")
    if expt_mesh is None:
        given = [a for a, v in (("hybrid_fsdp_expt_group", hybrid_expt_group),
                                ("expt_fsdp_group_ag", expt_group_ag)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} was given without expt_device_mesh; expert parallelism "
                             "needs the expert mesh (its dims named like device_mesh's)")
        marked = [n for n, p in module.named_parameters() if getattr(p, "allreduce", True) is False]
        if marked:
            raise ValueError(f"parameter {marked[0]!r} is an expert-parallel param (allreduce=False) but no "
                             "expt_device_mesh was given; pass the expert mesh so expert params shard over "
                             "the expert-data-parallel group")
        return None
    if not isinstance(expt_mesh, DeviceMesh):
        raise TypeError(f"expt_device_mesh must be a torch DeviceMesh or None, got {type(expt_mesh).__name__}")
    if expt_mesh.size() != dist.get_world_size():
        raise ValueError(f"expt_device_mesh has {expt_mesh.size()} ranks (shape {tuple(expt_mesh.shape)}) but "
                         f"the world has {dist.get_world_size()}; the expert mesh must cover every rank")
    names = mesh_dim_names(expt_mesh)
    for arg, dim in (("dp_shard_dim", dp_shard_dim), ("dp_outer_dim", dp_outer_dim)):
        if dim is not None and dim not in names:
            raise ValueError(f"expt_device_mesh has no dim {arg}={dim!r} (expert params shard over the "
                             f"expert mesh's dims of the same names); its dims: {names}")
    return resolve_parallel_dims(expt_mesh, expt_mesh[dp_shard_dim], dp_shard_dim, dp_outer_dim,
                                 tp_dim if tp_dim in names else None, hybrid_expt_group, strategy, outer,
                                 group_arg="hybrid_fsdp_expt_group")


def split_experts(group: list[ManagedParam]) -> tuple[list[ManagedParam], list[ManagedParam]]:
    """``(ordinary, expert)`` params of one unit, each in the unit's order."""
    expert = [p for p in group if is_expert_param(p.fqn, p.orig)]
    ordinary = [p for p in group if not is_expert_param(p.fqn, p.orig)]
    return ordinary, expert
