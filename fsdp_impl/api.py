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

from .buffers import ParamAndGradBuffer
from .decoupled import check_decoupled_grad_consistency
from .device import CommStreams, pick_device
from .discovery import UnitSpec, assign_params, find_unit_modules, resolve_unit_classes
from .engine import FSDPEngine
from .fp8_params import check_fp8_params, model_fp8, unit_fp8
from .grad_reduce import OuterGradReducer, two_level_groups
from .hooks import register_hooks
from .mesh import DistIndex, build_mesh, submesh
from .meta_init import materialise, sync_rng_from_rank0
from .module import FullyShardedModule
from .optimizer_binding import ENGINE_REF_ATTR, attach_engines, remap_optimizer_params
from .parallel_dims import ParallelDims, attach_tp_specs, resolve_parallel_dims
from .param import ManagedParam
from .policy import MixedPrecisionPolicy, ShardingStrategy, parse_strategy
from .unit import FSDPUnit, UnitContext

logger = logging.getLogger(__name__)

Strategy = str | int

# fully_shard_model's default policy (fp32 main params); frozen, so one shared instance is safe.
DEFAULT_MIXED_PRECISION_POLICY = MixedPrecisionPolicy()


def _not_implemented(what: str, unsupported: str, allowed: str) -> NotImplementedError:
    return NotImplementedError(f"{what} is not implemented yet: {unsupported} is not supported; {allowed}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _validate(module: nn.Module, mesh: DeviceMesh, dp_outer_dim: str | None, tp_dim: str | None,
              strategy: ShardingStrategy, outer: ShardingStrategy, meta_init: bool, policy: Any,
              flags: dict[str, Any]) -> None:
    """Checks that need the mesh; raise before anything is allocated."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    if isinstance(module, FullyShardedModule):
        raise ValueError("module is already wrapped by fully_shard")
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
    if flags["cuda_graph_mode"]:
        raise _not_implemented("cuda_graph_mode=True", "capturing the FSDP hooks and collectives in CUDA graphs",
                               "pass cuda_graph_mode=False")
    check_fp8_params(module, strategy, policy, flags["keep_fp8_transpose_cache"])
    if meta_init and strategy == ShardingStrategy.NO_SHARD:
        raise ValueError("init_model_with_meta_device=True is not supported with zero_dp_strategy="
                         "'no_shard'/0 (every rank would hold the whole model anyway); allowed "
                         "strategies: 'optim'/1, 'optim_grads'/2, 'optim_grads_params'/3")


def _shard_units(module: nn.Module, units: list[FSDPUnit], unit_modules: list[nn.Module],
                 groups: list[list[ManagedParam]], ctx: UnitContext, meta_init: bool) -> None:
    """Fill every unit's weight buffer (materialising meta tensors unit by unit if asked)."""
    has_meta = any(p.orig.is_meta for g in groups for p in g) or any(b.is_meta for b in module.buffers())
    if has_meta and not meta_init:
        raise ValueError("module has tensors on the meta device; pass init_model_with_meta_device=True "
                         "to materialise them, or build the module on a real device")
    if meta_init:
        sync_rng_from_rank0(ctx.device, None)  # the whole world: outer/TP/CP replicas init alike too
        materialise(module, groups, unit_modules, ctx.device, lambda i: units[i].shard_from_module())
        return
    for sub in module.modules():
        for name, buf in list(sub._buffers.items()):
            if buf is not None and buf.device != ctx.device:
                sub._buffers[name] = buf.to(ctx.device)
    for unit in units:
        unit.shard_from_module()


def fully_shard_model(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    dp_shard_dim: str | None = None,
    dp_outer_dim: str | None = None,
    tp_dim: str | None = None,
    hybrid_fsdp_group: dist.ProcessGroup | None = None,
    fsdp_unit_modules: UnitSpec = None,
    zero_dp_strategy: Strategy = 3,
    outer_dp_sharding_strategy: Strategy = 0,
    init_model_with_meta_device: bool = False,
    mixed_precision_policy: MixedPrecisionPolicy = DEFAULT_MIXED_PRECISION_POLICY,
    sync_model_each_microbatch: bool = True,
    report_nan_in_param_grad: bool = False,
    use_decoupled_grad: bool = False,
    cuda_graph_mode: bool = False,
    keep_fp8_transpose_cache: bool = False,
) -> FullyShardedModule:
    """Shard ``module``'s params over the dp-shard mesh dim and return the wrapper module."""
    strategy = parse_strategy(zero_dp_strategy)
    outer = parse_strategy(outer_dp_sharding_strategy, "outer_dp_sharding_strategy",
                           (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM))
    flags = dict(init_model_with_meta_device=init_model_with_meta_device,
                 sync_model_each_microbatch=sync_model_each_microbatch,
                 report_nan_in_param_grad=report_nan_in_param_grad, use_decoupled_grad=use_decoupled_grad,
                 cuda_graph_mode=cuda_graph_mode, keep_fp8_transpose_cache=keep_fp8_transpose_cache)
    classes = resolve_unit_classes(fsdp_unit_modules)
    mesh, shard_mesh = build_mesh(device_mesh, dp_shard_dim)
    _validate(module, mesh, dp_outer_dim, tp_dim, strategy, outer, init_model_with_meta_device,
              mixed_precision_policy, flags)
    dims = resolve_parallel_dims(mesh, shard_mesh, dp_shard_dim, dp_outer_dim, tp_dim, hybrid_fsdp_group,
                                 strategy, outer)
    shard_mesh = dims.shard_mesh  # HFSDP: the hybrid group; else the dp_shard_dim sub-mesh
    group = dims.shard_group or shard_mesh.get_group()
    found = find_unit_modules(module, classes)
    groups = assign_params(module, [name for name, _ in found])
    attach_tp_specs(groups, dims)
    device = pick_device(mesh)
    ctx = UnitContext(strategy=strategy, shard_mesh=shard_mesh, group=group, plan=dims.plan,
                      rank=dist.get_rank(group), world=dist.get_world_size(group), device=device,
                      policy=mixed_precision_policy, streams=CommStreams(device),
                      two_level=two_level_groups(dims, device),
                      fp8_setup=functools.partial(unit_fp8, keep_transpose=keep_fp8_transpose_cache))
    names = [name for name, _ in found] + [""]
    all_units = [FSDPUnit(name or "<root>", group, ctx) for name, group in zip(names, groups, strict=True)]
    unit_modules = [m for _, m in found]
    _shard_units(module, all_units, unit_modules, groups, ctx, init_model_with_meta_device)
    keep = [i for i, u in enumerate(all_units[:-1]) if u.params]  # units whose params all went to root
    units = [all_units[i] for i in keep] + [all_units[-1]]
    outer_reducer = OuterGradReducer(dims.hsdp_reduce_group) if dims.hsdp_reduce_group is not None else None
    engine = FSDPEngine(units, all_units[-1], ctx, sync_model_each_microbatch, use_decoupled_grad,
                        report_nan_in_param_grad, outer_reducer)
    # FP8 weights requantised over the shard group; delayed-scaling amaxes over every dp rank
    engine.fp8 = model_fp8(module, units, group, dims.hybrid_group or group)
    handles = register_hooks(engine, [unit_modules[i] for i in keep] + [module])
    buffer = ParamAndGradBuffer([u.group for u in units], use_decoupled_grad)
    dist_index = DistIndex(mesh, dims.inner_mesh, dims.outer_group, dims.hybrid_group, dims.tp_group)
    wrapper = FullyShardedModule(module, engine, buffer, dist_index, handles)
    for unit in units:
        for p in unit.params:
            setattr(p.sharded, ENGINE_REF_ATTR, weakref.ref(engine))  # what fully_shard_optimizer finds
    if logger.isEnabledFor(logging.DEBUG):
        _log_wrap(engine, dims)
    return wrapper


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
    """id(original param) -> DTensor shard, plus the shards themselves (already-remapped optimizers)."""
    mapping: dict[int, nn.Parameter] = {}
    for unit in model._fsdp_engine.units:
        for p in unit.params:
            mapping[id(p.orig)] = p.sharded
            mapping[id(p.sharded)] = p.sharded
    return mapping


def fully_shard(module: nn.Module, optimizer: torch.optim.Optimizer, **kwargs: Any
                ) -> tuple[FullyShardedModule, torch.optim.Optimizer]:
    """``fully_shard_model`` + point ``optimizer``'s param groups at the shards (``**kwargs`` are
    ``fully_shard_model``'s arguments)."""
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
    _check_bool("use_decoupled_grad", kwargs.get("use_decoupled_grad", False))  # fail before wrapping
    check_decoupled_grad_consistency(kwargs.get("use_decoupled_grad", False), optimizer)
    model = fully_shard_model(module, **kwargs)
    remap_optimizer_params(optimizer, _param_mapping(model))
    return model, fully_shard_optimizer(optimizer)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Make ``optimizer`` (built on a wrapped model's ``parameters()``) reset the FSDP grad
    buffers in ``zero_grad``; returns the same object."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
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
    return attach_engines(optimizer, engines)
