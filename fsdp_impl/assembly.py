"""Build a wrapped model from a checked ``FSDPConfig``: resolve the groups, agree across ranks,
then units, engine, hooks and the wrapper (``wrap_model``; ``api`` is only the public surface).

``GroupSet`` is one set of groups that units shard over: the ordinary data-parallel groups, and
with expert parallelism a second set over the expert mesh. Each has its own ``UnitContext``
(shard group, placements, grad scaling, all-gather group); a ``fsdp_unit_modules`` match (or the
root) whose params belong to both sets becomes two units driven by the same module's hooks.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .agreement import agreement_items, check_ranks_agree
from .buffers import ParamAndGradBuffer
from .config import FSDPConfig
from .device import CommStreams, release_cached_memory, resolve_device
from .discovery import assign_params, find_unit_modules
from .engine import FSDPEngine
from .expert import resolve_expert_dims, split_experts
from .fp8.params import has_fp8_params, model_fp8, unit_fp8
from .grad_reduce import GradScaling, OuterGradReducer, two_level_groups
from .graph_mode import check_cuda_graph_mode
from .hooks import register_hooks
from .mesh import DistIndex, build_mesh
from .meta_init import materialise, sync_rng_from_rank0
from .module import FullyShardedModule
from .nccl_ub import UserBuffers, registration_groups
from .nccl_ub import check_backend as check_nccl_backend
from .offload.host import ModelOffload, check_offload, check_window
from .optimizer_binding import ENGINE_REF_ATTR
from .parallel_dims import ParallelDims, attach_tp_specs, check_gather_group, resolve_parallel_dims
from .param import ManagedParam
from .unit import FSDPUnit, attach_unshard_pool
from .unit_context import UnitContext
from .validation import validate

EXPERT_SUFFIX = "[experts]"
logger = logging.getLogger("fsdp_impl.api")


@dataclass(frozen=True)
class MeshArgs:
    """``fully_shard``'s mesh and group arguments, as given."""

    device_mesh: DeviceMesh | None = None
    dp_shard_dim: str | None = None
    dp_outer_dim: str | None = None
    tp_dim: str | None = None
    hybrid_fsdp_group: dist.ProcessGroup | None = None
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None
    expt_device_mesh: DeviceMesh | None = None
    fsdp_group_ag: dist.ProcessGroup | None = None
    expt_fsdp_group_ag: dist.ProcessGroup | None = None


def dp_size_of(dims: ParallelDims) -> int:
    """Every data-parallel rank of a group set: the hybrid group under HSDP/HFSDP, else the
    dp_shard (x cp) group."""
    if dims.hybrid_group is not None:
        return dist.get_world_size(dims.hybrid_group)
    return dims.inner_mesh.size()


@dataclass(frozen=True)
class GroupSet:
    """Resolved groups plus what the units over them are given."""

    dims: ParallelDims
    scaling: GradScaling
    gather_group: dist.ProcessGroup | None = None


def make_context(groups: GroupSet, config: FSDPConfig, device: torch.device, streams: CommStreams,
                 user_buffers: UserBuffers | None) -> UnitContext:
    """The context of the units over ``groups`` (``two_level_groups`` is a collective)."""
    group = groups.dims.shard_group or groups.dims.shard_mesh.get_group()
    return UnitContext(config=config, shard_mesh=groups.dims.shard_mesh, group=group, plan=groups.dims.plan,
                       rank=dist.get_rank(group), world=dist.get_world_size(group), device=device, streams=streams,
                       two_level=two_level_groups(groups.dims, device), grad_scaling=groups.scaling,
                       gather_group=groups.gather_group, fp8_setup=unit_fp8, user_buffers=user_buffers)


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


def _scaling(config: FSDPConfig, dp_size: int, reduce_size: int) -> GradScaling:
    return GradScaling.for_units(config.average_in_collective, config.calculate_per_token_loss, dp_size, reduce_size)


def comm_groups(dims: ParallelDims, gather_group: dist.ProcessGroup | None,
                prefix: str = "") -> list[tuple[str, dist.ProcessGroup | None]]:
    """The groups a model's collectives run on, named, in a fixed order (NCCL user buffers
    register with each, in this order): shard, all-gather, HFSDP inner, outer, HSDP outer
    reduce, hybrid."""
    shard = dims.shard_group or dims.shard_mesh.get_group()
    inner = dims.inner_mesh.get_group() if dims.outer_group is not None else None
    named = [("shard", shard), ("all-gather", gather_group), ("inner", inner), ("outer", dims.outer_group),
             ("hsdp outer reduce", dims.hsdp_reduce_group), ("hybrid", dims.hybrid_group)]
    return [(prefix + name, g) for name, g in named]


def wrap_model(module: nn.Module, config: FSDPConfig, classes: tuple[type[nn.Module], ...], mesh_args: MeshArgs,
               device: object) -> FullyShardedModule:
    """Resolve the mesh and groups, check the module against them, make every rank agree, then
    build the wrapper (nothing is allocated before the checks pass)."""
    m = mesh_args
    mesh, inner_mesh = build_mesh(m.device_mesh, m.dp_shard_dim, m.tp_dim)
    validate(module, mesh, m.dp_outer_dim, m.tp_dim, config)
    config = config.with_unshard(
        check_cuda_graph_mode(mesh.device_type, config.report_nan_in_param_grad, config.unshard)
        if config.cuda_graph_mode else config.unshard.resolve(False))
    dims = resolve_parallel_dims(mesh, inner_mesh, m.dp_shard_dim, m.dp_outer_dim, m.tp_dim, m.hybrid_fsdp_group,
                                 config.strategy, config.outer_strategy)
    shard_dim = m.dp_shard_dim or (inner_mesh.mesh_dim_names or ("",))[0]
    expert_dims = resolve_expert_dims(module, m.expt_device_mesh, shard_dim, m.dp_outer_dim, m.tp_dim,
                                      m.hybrid_fsdp_expt_group, m.expt_fsdp_group_ag, config.strategy,
                                      config.outer_strategy)
    if expert_dims is not None and has_fp8_params(module):
        raise NotImplementedError("expt_device_mesh with FP8 parameters is not implemented yet: requantising FP8 "
                                  "weights over a separate expert group is not supported; pass "
                                  "expt_device_mesh=None, or build the model without FP8 parameters")
    resolved_device = resolve_device(device, mesh)
    check_offload(config.offload_policy, resolved_device, config.cuda_graph_mode, module)
    check_gather_group(m.fsdp_group_ag, dims, "fsdp_group_ag")
    if expert_dims is not None:
        check_gather_group(m.expt_fsdp_group_ag, expert_dims, "expt_fsdp_group_ag")
    ub_groups: list[tuple[str, dist.ProcessGroup]] = []
    if config.nccl_ub:
        groups = comm_groups(dims, m.fsdp_group_ag)
        if expert_dims is not None:
            groups += comm_groups(expert_dims, m.expt_fsdp_group_ag, "expert ")
        ub_groups = registration_groups(groups)
        check_nccl_backend([g for _, g in ub_groups])
    items = agreement_items(module, mesh, classes, config, dims, expert_dims, resolved_device)
    # rank-independent: which groups, by role and size, in which order (ranks differ per replica)
    items.append(("nccl_ub registration order (group, size)", [(n, g.size()) for n, g in ub_groups]))
    check_ranks_agree(items, resolved_device)
    dp_size = dp_size_of(dims)
    ordinary = GroupSet(dims, _scaling(config, dp_size, dp_size), m.fsdp_group_ag)
    experts = None
    if expert_dims is not None:
        experts = GroupSet(expert_dims, _scaling(config, dp_size, dp_size_of(expert_dims)), m.expt_fsdp_group_ag)
    user_buffers = (UserBuffers([g for _, g in ub_groups], resolved_device, not config.disable_symmetric_registration)
                     if config.nccl_ub else None)
    return _assemble(module, classes, config, resolved_device, ordinary, experts, user_buffers)


def _assemble(module: nn.Module, classes: tuple[type[nn.Module], ...], config: FSDPConfig, device: torch.device,
              ordinary: GroupSet, experts: GroupSet | None, user_buffers: UserBuffers | None) -> FullyShardedModule:
    """Units, engine, hooks and wrapper (the arguments are checked and agreed on). With NCCL user
    buffers, every buffer the units allocate comes from their pool."""
    found = find_unit_modules(module, classes)
    names = [name for name, _ in found] + [""]
    layout = split_units(names, [m for _, m in found] + [module], assign_params(module, names[:-1]),
                         ordinary.dims, experts.dims if experts is not None else None)
    streams = CommStreams(device, config.overlap_param_gather, config.overlap_grad_reduce,
                          record_streams=not config.cuda_graph_mode)
    ctx = make_context(ordinary, config, device, streams, user_buffers)
    expert_ctx = make_context(experts, config, device, streams, user_buffers) if experts is not None else None
    parts = [(ordinary, ctx) for ordinary, _ in layout.parts]
    parts += [(expert, expert_ctx) for _, expert in layout.parts if expert_ctx is not None]
    check_window(config.offload_policy, parts, device)  # before any buffer exists (a collective)
    with user_buffers.allocating() if user_buffers is not None else contextlib.nullcontext():
        per_match, units, modules = build_units(layout, ctx, expert_ctx)
        shard_units(module, per_match, layout, device, config.init_model_with_meta_device)
        for context in (ctx, expert_ctx):  # ZeRO-3 + pool only: the non-root units of each group set
            if context is not None:
                attach_unshard_pool([u for u in units[:-1] if u.ctx is context], context)
    reducer = outer_reducer(units, ordinary.dims, experts.dims if experts is not None else None, expert_ctx,
                            ordinary.scaling)
    # FP8 weights requantised over the shard group; delayed-scaling amaxes over every dp rank
    fp8 = model_fp8(module, units, ctx.group, ordinary.dims.hybrid_group or ctx.group)
    offload = ModelOffload(config.offload_policy, device) if config.offload_policy is not None else None
    engine = FSDPEngine(units, units[-1], ctx, reducer, fp8, offload)
    handles = register_hooks(engine, modules)
    buffer = ParamAndGradBuffer([u.group for u in units], config.use_decoupled_grad)
    wrapper = FullyShardedModule(module, engine, buffer, _dist_index(ordinary, experts), handles)
    for unit in units:
        for p in unit.params:
            setattr(p.sharded, ENGINE_REF_ATTR, weakref.ref(engine))  # what fully_shard_optimizer finds
            p.release_orig()  # the user's unsharded tensors must not outlive the wrap
    release_cached_memory(device)  # what the wrap freed must not fragment the first step's memory
    if logger.isEnabledFor(logging.DEBUG):
        _log_wrap(engine, ordinary.dims)
    return wrapper


def _dist_index(ordinary: GroupSet, experts: GroupSet | None) -> DistIndex:
    def index(g: GroupSet, expert: DistIndex | None = None) -> DistIndex:
        d = g.dims
        return DistIndex(d.mesh, d.inner_mesh, d.outer_group, d.hybrid_group, d.tp_group, g.gather_group, expert)
    return index(ordinary, index(experts) if experts is not None else None)


def _log_wrap(engine: FSDPEngine, dims: ParallelDims) -> None:
    """Debug summary of a wrap: strategy, groups, and per unit its params and shard sizes."""
    ctx = engine.ctx
    logger.debug("fully_shard: strategy=%s, shard group rank %d of %d on %s, HSDP outer reduce=%s, "
                 "HFSDP two-level reduce=%s, tp=%s, %d units", ctx.config.strategy.name.lower(), ctx.rank,
                 ctx.world, ctx.device, dims.hsdp_reduce_group is not None, ctx.two_level is not None,
                 dims.tp_dim if dims.tp_group is not None else None, len(engine.units))
    for unit in engine.units:
        grad_numel = unit.grad.layout.segment_numel if unit.grad is not None else 0
        logger.debug("fully_shard unit %r: %d params (%d trainable), weight shard %d x %s, grad shard %d x %s",
                     unit.name, len(unit.params), len(unit.trainable), unit.weight.layout.segment_numel,
                     unit.dtypes.main_params, grad_numel, unit.dtypes.main_grads)
