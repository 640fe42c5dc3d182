"""Build a wrapped model's units and engine from arguments ``api`` has already checked.

``GroupSet`` is one set of groups that units shard over: the ordinary data-parallel groups, and
with expert parallelism a second set over the expert mesh. Each has its own ``UnitContext``
(shard group, placements, grad scaling, all-gather group); a ``fsdp_unit_modules`` match (or the
root) whose params belong to both sets becomes two units driven by the same module's hooks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .device import CommStreams
from .expert import split_experts
from .grad_reduce import GradScaling, OuterGradReducer, two_level_groups
from .meta_init import materialise, sync_rng_from_rank0
from .parallel_dims import ParallelDims, attach_tp_specs
from .param import ManagedParam
from .policy import MixedPrecisionPolicy, ShardingStrategy
from .unit import FSDPUnit, UnitContext
from .unshard_storage import UnshardStorage

EXPERT_SUFFIX = "[experts]"


@dataclass
class GroupSet:
    """Resolved groups plus what the units over them are given."""

    dims: ParallelDims
    scaling: GradScaling
    gather_group: dist.ProcessGroup | None = None

    @property
    def dp_size(self) -> int:
        """Every data-parallel rank of this set: the hybrid group under HSDP/HFSDP, else the
        dp_shard (x cp) group."""
        if self.dims.hybrid_group is not None:
            return dist.get_world_size(self.dims.hybrid_group)
        return self.dims.inner_mesh.size()


def make_context(groups: GroupSet, strategy: ShardingStrategy, policy: MixedPrecisionPolicy,
                 device: torch.device, streams: CommStreams, prefetch: bool, graph_mode: bool,
                 unshard: UnshardStorage) -> UnitContext:
    """The context of the units over ``groups`` (``two_level_groups`` is a collective)."""
    group = groups.dims.shard_group or groups.dims.shard_mesh.get_group()
    return UnitContext(strategy=strategy, shard_mesh=groups.dims.shard_mesh, group=group,
                       plan=groups.dims.plan, rank=dist.get_rank(group), world=dist.get_world_size(group),
                       device=device, policy=policy, streams=streams,
                       two_level=two_level_groups(groups.dims, device), grad_scaling=groups.scaling,
                       gather_group=groups.gather_group, prefetch=prefetch, graph_mode=graph_mode,
                       unshard=unshard)


@dataclass
class UnitLayout:
    """Per ``fsdp_unit_modules`` match (root last): its params split into the ordinary and the
    expert part (the expert part empty without expert parallelism)."""

    names: list[str]
    modules: list[nn.Module]
    parts: list[tuple[list[ManagedParam], list[ManagedParam]]]


def split_units(names: list[str], modules: list[nn.Module], groups: list[list[ManagedParam]],
                dims: ParallelDims, expert_dims: ParallelDims | None) -> UnitLayout:
    """Split each unit's params by group set and record their TP specs against its mesh."""
    parts = [split_experts(g) if expert_dims is not None else (g, []) for g in groups]
    attach_tp_specs([ordinary for ordinary, _ in parts], dims)
    if expert_dims is not None:
        attach_tp_specs([expert for _, expert in parts], expert_dims)
    return UnitLayout(names, modules, parts)


def build_units(layout: UnitLayout, ctx: UnitContext, expert_ctx: UnitContext | None
                ) -> tuple[list[list[FSDPUnit]], list[FSDPUnit], list[nn.Module]]:
    """Units per match (``[ordinary, expert]`` parts that have params; the root's ordinary unit
    always exists and comes last), and the flat ``(units, modules)`` lists the engine and the
    hooks take. A non-root match whose params all went to the root gets no unit."""
    per_match: list[list[FSDPUnit]] = []
    units: list[FSDPUnit] = []
    modules: list[nn.Module] = []
    last = len(layout.parts) - 1
    for i, (name, (ordinary, expert)) in enumerate(zip(layout.names, layout.parts, strict=True)):
        label = name or "<root>"
        made = []
        if expert:
            assert expert_ctx is not None  # expert params are only split off with an expert mesh
            made.append(FSDPUnit(f"{label}{EXPERT_SUFFIX}", expert, expert_ctx))
        if ordinary or i == last:
            made.append(FSDPUnit(label, ordinary, ctx))
        per_match.append(made)
    for i, made in enumerate(per_match):
        for unit in made:
            if unit.params or i == last:
                units.append(unit)
                modules.append(layout.modules[i])
    return per_match, units, modules


def shard_units(module: nn.Module, per_match: list[list[FSDPUnit]], layout: UnitLayout,
                device: torch.device, meta_init: bool) -> None:
    """Fill every unit's weight buffer (materialising meta tensors unit by unit if asked)."""
    groups = [ordinary + expert for ordinary, expert in layout.parts]
    has_meta = any(p.orig.is_meta for g in groups for p in g) or any(b.is_meta for b in module.buffers())
    if has_meta and not meta_init:
        raise ValueError("module has tensors on the meta device; pass init_model_with_meta_device=True "
                         "to materialise them, or build the module on a real device")
    if meta_init:
        sync_rng_from_rank0(device, None)  # the whole world: outer/TP/CP replicas init alike too
        def shard(i: int) -> None:
            for unit in per_match[i]:
                unit.shard_from_module()

        materialise(module, groups, layout.modules[:-1], device, shard)
        return
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)
    for made in per_match:
        for unit in made:
            unit.shard_from_module()


def outer_reducer(units: list[FSDPUnit], dims: ParallelDims, expert_dims: ParallelDims | None,
                  expert_ctx: UnitContext | None, scaling: GradScaling) -> OuterGradReducer | None:
    """HSDP: each unit's dp_outer group (the expert mesh's for expert units), or ``None`` when
    no unit has one."""
    groups = [expert_dims.hsdp_reduce_group if expert_dims is not None and u.ctx is expert_ctx
              else dims.hsdp_reduce_group for u in units]
    if all(g is None for g in groups):
        return None
    return OuterGradReducer(groups, scaling.op)
