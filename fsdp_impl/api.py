"""Public entry points: ``fully_shard``, ``fully_shard_model``, ``fully_shard_optimizer``.

All argument checks run before any buffer is allocated or collective issued, so bad input fails
early and identically on every rank with a message naming the argument and the allowed values.
"""
from __future__ import annotations

import functools
import logging
import weakref
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .agreement import check_ranks_agree
from .assembly import GroupSet, build_units, make_context, outer_reducer, shard_units, split_units
from .buffers import ParamAndGradBuffer
from .dcp_optim_state import PlaceholderStateHook
from .decoupled import check_decoupled_grad_consistency
from .device import CommStreams
from .discovery import UnitSpec, assign_params, find_unit_modules, resolve_unit_classes
from .engine import FSDPEngine
from .expert import is_expert_param, resolve_expert_dims
from .fp8_params import check_fp8_params, has_fp8_params, model_fp8, unit_fp8
from .grad_reduce import GradScaling
from .graph_mode import check_cuda_graph_mode, check_optimizer_capturable
from .hooks import register_hooks
from .mesh import DistIndex, build_mesh, submesh
from .module import FullyShardedModule
from .optimizer_binding import ENGINE_REF_ATTR, attach_engines, remap_optimizer_params
from .options import WrapOptions, resolve_device
from .parallel_dims import ParallelDims, check_gather_group, resolve_parallel_dims
from .policy import MixedPrecisionPolicy, ShardingStrategy, parse_strategy
from .unit import attach_unshard_pool
from .unshard_storage import UnshardStorage

logger = logging.getLogger(__name__)

Strategy = str | int

# fully_shard_model's default policy (fp32 main params); frozen, so one shared instance is safe.
DEFAULT_MIXED_PRECISION_POLICY = MixedPrecisionPolicy()
_PLACEHOLDER_HOOK_ATTR = "_fsdp_dcp_placeholder_hook"  # set once the state-dict hook is registered


def _not_implemented(what: str, unsupported: str, allowed: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not implemented yet: {unsupported} is not supported; {allowed}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_not_wrapped(module: nn.Module) -> None:
    """Refuse a wrapped model, its inner module or anything containing a wrapped part: their
    params are already DTensor shards, which the checks further on would misreport as TP params."""
    if isinstance(module, FullyShardedModule):
        raise ValueError("module is already wrapped by fully_shard (it is the wrapper it returned); "
                         "wrap the original module once")
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedModule):
            raise ValueError(f"module contains a model already wrapped by fully_shard (submodule "
                             f"{name!r}); fully_shard cannot be nested: wrap the original module once")
    for name, param in module.named_parameters():
        if getattr(param, ENGINE_REF_ATTR, None) is not None:
            raise ValueError(f"module is (part of) a model already wrapped by fully_shard: its parameter "
                             f"{name!r} is a shard owned by that model; wrap the original module once")


def _validate(module: nn.Module, mesh: DeviceMesh, dp_outer_dim: str | None, tp_dim: str | None,
              strategy: ShardingStrategy, outer: ShardingStrategy, meta_init: bool, policy: Any,
              flags: dict[str, Any]) -> None:
    """Checks that need the mesh; raise before anything is allocated."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    _check_not_wrapped(module)
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mixed_precision_policy must be a fsdp_impl.MixedPrecisionPolicy, got {policy!r}")
    for name, value in flags.items():
        _check_bool(name, value)
    if dp_outer_dim is not None:
        submesh(mesh, dp_outer_dim, "dp_outer_dim")
    if tp_dim is not None:
        submesh(mesh, tp_dim, "tp_dim")
    if outer == ShardingStrategy.OPTIM and strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(f"outer_dp_sharding_strategy='optim'/1 requires zero_dp_strategy="
                         f"'optim_grads_params'/3, got zero_dp_strategy={strategy.name.lower()!r}/{int(strategy)}")
    check_fp8_params(module, strategy, policy, flags["keep_fp8_transpose_cache"])
    if meta_init and strategy == ShardingStrategy.NO_SHARD:
        raise ValueError("init_model_with_meta_device=True is not supported with zero_dp_strategy="
                         "'no_shard'/0 (every rank would hold the whole model anyway); allowed "
                         "strategies: 'optim'/1, 'optim_grads'/2, 'optim_grads_params'/3")


def _agreement_items(module: nn.Module, mesh: DeviceMesh, classes: tuple[type, ...],
                     strategy: ShardingStrategy, outer: ShardingStrategy, policy: MixedPrecisionPolicy,
                     flags: dict[str, Any], options: WrapOptions, dims: ParallelDims,
                     expert_dims: ParallelDims | None, device: torch.device) -> list[tuple[str, Any]]:
    """What every rank must pass identically, as rank-independent values (names, not objects)."""
    params = [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad,
               is_expert_param(name, p) and expert_dims is not None)
              for name, p in module.named_parameters()]

    def mesh_of(d: ParallelDims | None) -> Any:
        return None if d is None else (d.mesh.device_type, d.mesh.mesh.tolist(), d.mesh.mesh_dim_names,
                                       d.inner_mesh.mesh_dim_names, d.outer_group is not None,
                                       None if d.hybrid_group is None else dist.get_world_size(d.hybrid_group))

    return [
        ("zero_dp_strategy", f"{strategy.name.lower()!r}/{int(strategy)}"),
        ("outer_dp_sharding_strategy", f"{outer.name.lower()!r}/{int(outer)}"),
        ("fsdp_unit_modules", tuple(f"{c.__module__}.{c.__qualname__}" for c in classes)),
        ("mixed_precision_policy", repr(policy)),
        ("flags", dict(sorted(flags.items()))),
        ("options", repr(options)),
        ("device type", device.type),
        ("device_mesh", (mesh.device_type, mesh.mesh.tolist(), mesh.mesh_dim_names)),
        ("(mesh, dp_shard_dim, dp_outer given, hybrid_fsdp_group size)", mesh_of(dims)),
        ("tp_dim", dims.tp_dim),
        ("expt_device_mesh (mesh, dp_shard_dim, dp_outer given, hybrid_fsdp_expt_group size)",
         mesh_of(expert_dims)),
        ("module class", f"{type(module).__module__}.{type(module).__qualname__}"),
        ("parameters (name, shape, dtype, requires_grad, expert)", params),
    ]


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    fsdp_unit_modules: UnitSpec = None,
    zero_dp_strategy: Strategy = 3,
    outer_dp_sharding_strategy: Strategy = 0,
    device: torch.device | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = DEFAULT_MIXED_PRECISION_POLICY,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    maxpool_double_buffer: bool = False,
) -> FullyShardedModule:
    """Shard ``module``'s params over the dp-shard mesh dim and return the wrapper module.

    The arguments, their order and defaults are Megatron-FSDP 0.6.1's; what each switch does
    here is described in ``fsdp_impl.options`` and ``fsdp_impl/README.md``."""
    strategy = parse_strategy(zero_dp_strategy)
    outer = parse_strategy(outer_dp_sharding_strategy, "outer_dp_sharding_strategy",
                           (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM))
    flags = dict(init_model_with_meta_device=init_model_with_meta_device,
                 sync_model_each_microbatch=sync_model_each_microbatch,
                 report_nan_in_param_grad=report_nan_in_param_grad, use_decoupled_grad=use_decoupled_grad,
                 cuda_graph_mode=cuda_graph_mode, keep_fp8_transpose_cache=keep_fp8_transpose_cache)
    options = WrapOptions(overlap_grad_reduce, overlap_param_gather, preproc_state_dict_for_dcp_ckpt,
                          average_in_collective, disable_bucketing, calculate_per_token_loss, nccl_ub,
                          fsdp_double_buffer, fsdp_db_use_persist_buf_on_alloc_fail,
                          disable_symmetric_registration, enable_fine_grained_param_gather, maxpool_double_buffer)
    classes = resolve_unit_classes(fsdp_unit_modules)
    mesh, inner_mesh = build_mesh(device_mesh, dp_shard_dim, tp_dim)
    _validate(module, mesh, dp_outer_dim, tp_dim, strategy, outer, init_model_with_meta_device,
              mixed_precision_policy, flags)
    unshard = UnshardStorage.from_megatron_args(fsdp_double_buffer, maxpool_double_buffer)
    unshard = (check_cuda_graph_mode(mesh.device_type, report_nan_in_param_grad, unshard) if cuda_graph_mode
               else unshard.resolve(False))
    dims = resolve_parallel_dims(mesh, inner_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group,
                                 strategy, outer)
    shard_dim = dp_shard_dim or (inner_mesh.mesh_dim_names or ("",))[0]
    expert_dims = resolve_expert_dims(module, expt_device_mesh, shard_dim, dp_outer_dim, tp_dim,
                                      hybrid_fsdp_expt_group, expt_fsdp_group_ag, strategy, outer)
    if expert_dims is not None and has_fp8_params(module):
        raise _not_implemented("expt_device_mesh with FP8 parameters",
                               "requantising FP8 weights over a separate expert group",
                               "pass expt_device_mesh=None, or build the model without FP8 parameters")
    resolved_device = resolve_device(device, mesh)
    check_gather_group(fsdp_group_ag, dims, "fsdp_group_ag")
    if expert_dims is not None:
        check_gather_group(expt_fsdp_group_ag, expert_dims, "expt_fsdp_group_ag")
    check_ranks_agree(_agreement_items(module, mesh, classes, strategy, outer, mixed_precision_policy, flags,
                                       options, dims, expert_dims, resolved_device), resolved_device)
    ordinary = GroupSet(dims, GradScaling(), fsdp_group_ag)
    ordinary.scaling = _scaling(options, ordinary.dp_size, ordinary.dp_size)
    experts = None
    if expert_dims is not None:
        experts = GroupSet(expert_dims, GradScaling(), expt_fsdp_group_ag)
        experts.scaling = _scaling(options, ordinary.dp_size, experts.dp_size)
    return _assemble(module, classes, strategy, mixed_precision_policy, resolved_device, options, flags, unshard,
                     ordinary, experts)


def _scaling(options: WrapOptions, dp_size: int, reduce_size: int) -> GradScaling:
    return GradScaling.for_units(options.average_in_collective, options.calculate_per_token_loss,
                                 dp_size, reduce_size)


def _assemble(module: nn.Module, classes: tuple[type[nn.Module], ...], strategy: ShardingStrategy,
              policy: MixedPrecisionPolicy, device: torch.device, options: WrapOptions, flags: dict[str, bool],
              unshard: UnshardStorage, ordinary: GroupSet, experts: GroupSet | None) -> FullyShardedModule:
    """Units, engine, hooks and wrapper (the arguments are checked and agreed on)."""
    found = find_unit_modules(module, classes)
    names = [name for name, _ in found] + [""]
    layout = split_units(names, [m for _, m in found] + [module], assign_params(module, names[:-1]),
                         ordinary.dims, experts.dims if experts is not None else None)
    graph_mode = flags["cuda_graph_mode"]
    streams = CommStreams(device, options.overlap_param_gather, options.overlap_grad_reduce,
                          record_streams=not graph_mode)
    ctx = make_context(ordinary, strategy, policy, device, streams, options.overlap_param_gather, graph_mode,
                       unshard)
    ctx.fp8_setup = functools.partial(unit_fp8, keep_transpose=flags["keep_fp8_transpose_cache"])
    ctx.fine_grained = options.enable_fine_grained_param_gather
    expert_ctx = (make_context(experts, strategy, policy, device, streams, options.overlap_param_gather,
                               graph_mode, unshard) if experts is not None else None)
    if expert_ctx is not None:
        expert_ctx.fine_grained = options.enable_fine_grained_param_gather
    per_match, units, modules = build_units(layout, ctx, expert_ctx)
    shard_units(module, per_match, layout, device, flags["init_model_with_meta_device"])
    for context in (ctx, expert_ctx):  # ZeRO-3 + pool only: the non-root units of each group set
        if context is not None:
            attach_unshard_pool([u for u in units[:-1] if u.ctx is context], context)
    reducer = outer_reducer(units, ordinary.dims, experts.dims if experts is not None else None, expert_ctx,
                            ordinary.scaling)
    engine = FSDPEngine(units, units[-1], ctx, flags["sync_model_each_microbatch"], flags["use_decoupled_grad"],
                        flags["report_nan_in_param_grad"], reducer)
    # FP8 weights requantised over the shard group; delayed-scaling amaxes over every dp rank
    engine.fp8 = model_fp8(module, units, ctx.group, ordinary.dims.hybrid_group or ctx.group)
    handles = register_hooks(engine, modules)
    buffer = ParamAndGradBuffer([u.group for u in units], flags["use_decoupled_grad"])
    wrapper = FullyShardedModule(module, engine, buffer, _dist_index(ordinary, experts), handles)
    for unit in units:
        for p in unit.params:
            setattr(p.sharded, ENGINE_REF_ATTR, weakref.ref(engine))  # what fully_shard_optimizer finds
            p.release_orig()  # the user's unsharded tensors must not outlive the wrap
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
                 "HFSDP two-level reduce=%s, tp=%s, %d units", ctx.strategy.name.lower(), ctx.rank,
                 ctx.world, ctx.device, dims.hsdp_reduce_group is not None, ctx.two_level is not None,
                 dims.tp_dim if dims.tp_group is not None else None, len(engine.units))
    for unit in engine.units:
        grad_numel = unit.grad.layout.segment_numel if unit.grad is not None else 0
        logger.debug("fully_shard unit %r: %d params (%d trainable), weight shard %d x %s, grad shard %d x %s",
                     unit.name, len(unit.params), len(unit.trainable), unit.weight.layout.segment_numel,
                     unit.dtypes.main_params, grad_numel, unit.dtypes.main_grads)


def _param_mapping(model: FullyShardedModule) -> dict[int, nn.Parameter]:
    """id(original param) -> DTensor shard, plus the shards themselves (already-remapped optimizers).

    The original ids are only meaningful while the originals are alive: ``fully_shard`` checked
    before wrapping that every optimizer param is a module param, and the optimizer keeps those
    alive, so no id in its groups can have been reused by another object."""
    mapping: dict[int, nn.Parameter] = {}
    for unit in model._fsdp_engine.units:
        for p in unit.params:
            mapping[p.orig_id] = p.sharded
            mapping[id(p.sharded)] = p.sharded
    return mapping


def fully_shard(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    hybrid_fsdp_expt_group: dist.ProcessGroup | None = None,
    expt_device_mesh: DeviceMesh | None = None,
    fsdp_group_ag: dist.ProcessGroup | None = None,
    expt_fsdp_group_ag: dist.ProcessGroup | None = None,
    fsdp_unit_modules: UnitSpec = None,
    zero_dp_strategy: Strategy = 3,
    outer_dp_sharding_strategy: Strategy = 0,
    device: torch.device | None = None,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = DEFAULT_MIXED_PRECISION_POLICY,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = True,
    sync_model_each_microbatch: bool = True,
    preproc_state_dict_for_dcp_ckpt: bool = True,
    report_nan_in_param_grad: bool = False,
    average_in_collective: bool = False,
    disable_bucketing: bool = False,
    calculate_per_token_loss: bool = False,
    keep_fp8_transpose_cache: bool = False,
    nccl_ub: bool = False,
    fsdp_double_buffer: bool = False,
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False,
    disable_symmetric_registration: bool = False,
    enable_fine_grained_param_gather: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    maxpool_double_buffer: bool = False,
) -> tuple[FullyShardedModule, torch.optim.Optimizer]:
    """``fully_shard_model`` + point ``optimizer``'s param groups at the shards and
    ``fully_shard_optimizer`` (the other arguments are ``fully_shard_model``'s)."""
    kwargs = {k: v for k, v in locals().items() if k not in ("module", "optimizer")}
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(module, nn.Module):
        known = {id(p) for p in module.parameters()}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(f"optimizer param group {gi} holds a parameter of shape "
                                     f"{tuple(p.shape)} that is not a parameter of module; the "
                                     "optimizer's params must be the model's")
    _check_bool("use_decoupled_grad", use_decoupled_grad)  # fail before wrapping
    _check_bool("preproc_state_dict_for_dcp_ckpt", preproc_state_dict_for_dcp_ckpt)
    check_decoupled_grad_consistency(use_decoupled_grad, optimizer)
    if cuda_graph_mode is True:
        check_optimizer_capturable(optimizer)
    model = fully_shard_model(module, **kwargs)
    remap_optimizer_params(optimizer, _param_mapping(model))
    return model, fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Make ``optimizer`` (built on a wrapped model's ``parameters()``) reset the FSDP grad
    buffers in ``zero_grad``; returns the same object.

    ``preproc_state_dict_for_dcp_ckpt``: ``optimizer.state_dict()`` lists placeholder state for
    params that have not been stepped yet, so ``torch.distributed.checkpoint.load`` can load a
    checkpoint into a fresh optimizer (see ``fsdp_impl.dcp_optim_state``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    _check_bool("preproc_state_dict_for_dcp_ckpt", preproc_state_dict_for_dcp_ckpt)
    engines: list[FSDPEngine] = []
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            ref = getattr(p, ENGINE_REF_ATTR, None)
            engine = ref() if ref is not None else None
            if engine is None:
                raise ValueError(f"optimizer param group {gi} holds a parameter of shape {tuple(p.shape)} "
                                 "that is not a parameter of a fully_shard-ed model; build the "
                                 "optimizer on model.parameters() of the wrapped model")
            if all(engine is not e for e in engines):
                engines.append(engine)
    for engine in engines:
        check_decoupled_grad_consistency(engine.use_decoupled_grad, optimizer)
    if preproc_state_dict_for_dcp_ckpt and not getattr(optimizer, _PLACEHOLDER_HOOK_ATTR, False):
        optimizer.register_state_dict_post_hook(PlaceholderStateHook())
        setattr(optimizer, _PLACEHOLDER_HOOK_ATTR, True)
    return attach_engines(optimizer, engines)
