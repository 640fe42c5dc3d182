"""Public entry points: ``fully_shard``, ``fully_shard_model``, ``fully_shard_optimizer``.

Megatron-FSDP 0.6.1's signatures. ``fully_shard_model`` turns its arguments into one checked
``FSDPConfig`` (by keyword) and hands it to ``assembly.wrap_model``; all checks run before any
buffer is allocated or collective issued, so bad input fails early and identically on every rank
with a message naming the argument and the allowed values.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .assembly import MeshArgs, wrap_model
from .compile_units import CompileUnits, check_compile_units_fits, parse_compile_units
from .compile_units import compile_units as apply_compile_units
from .config import CONFIG_ARGUMENTS, FSDPConfig
from .dcp_optim_state import PlaceholderStateHook
from .decoupled import check_decoupled_grad_consistency
from .device import release_cached_memory
from .discovery import UnitSpec, resolve_unit_classes
from .engine import FSDPEngine
from .graph_mode import check_optimizer_capturable
from .module import FullyShardedModule
from .offload.host import OffloadPolicy
from .offload.optim import check_offload_optimizer
from .optimizer_binding import ENGINE_REF_ATTR, attach_engines, param_mapping, remap_optimizer_params
from .policy import MixedPrecisionPolicy, ShardingStrategy, check_bool, parse_strategy
from .validation import check_not_wrapped

Strategy = str | int

# fully_shard_model's default policy (fp32 main params); frozen, so one shared instance is safe.
DEFAULT_MIXED_PRECISION_POLICY = MixedPrecisionPolicy()
_PLACEHOLDER_HOOK_ATTR = "_fsdp_dcp_placeholder_hook"  # set once the state-dict hook is registered


def _check_optimizer(optimizer: object) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")


def _config(arguments: dict[str, Any]) -> FSDPConfig:
    """The checked ``FSDPConfig`` of an entry point's arguments (its ``locals()`` on entry: the
    switches are ``FSDPConfig``'s fields under the same names, so each is named once)."""
    switches = {name: arguments[name] for name in CONFIG_ARGUMENTS}
    return FSDPConfig(strategy=parse_strategy(arguments["zero_dp_strategy"]),
                      outer_strategy=parse_strategy(arguments["outer_dp_sharding_strategy"],
                                                    "outer_dp_sharding_strategy",
                                                    (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM)),
                      **switches)


def _wrap(module: nn.Module, config: FSDPConfig, arguments: dict[str, Any]) -> FullyShardedModule:
    """``assembly.wrap_model`` with the entry point's unit classes, mesh arguments and device."""
    mesh_args = MeshArgs(**{f.name: arguments[f.name] for f in dataclasses.fields(MeshArgs)})
    return wrap_model(module, config, resolve_unit_classes(arguments["fsdp_unit_modules"]), mesh_args,
                      arguments["device"])


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
    *,
    offload_policy: OffloadPolicy | None = None,
) -> FullyShardedModule:
    """Shard ``module``'s params over the dp-shard mesh dim and return the wrapper module.

    The positional arguments, their order and defaults are Megatron-FSDP 0.6.1's; what each switch
    does here is described in ``fsdp_impl.config`` and ``fsdp_impl/README.md``. Keyword-only
    extension: ``offload_policy`` (``fsdp_impl.OffloadPolicy``: optimizer state, main params and
    grads in host memory, the step on the CPU or streamed through the GPU)."""
    arguments = dict(locals())
    return _wrap(module, _config(arguments), arguments)


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
    *,
    offload_policy: OffloadPolicy | None = None,
    compile_units: CompileUnits = None,
) -> tuple[FullyShardedModule, torch.optim.Optimizer]:
    """``fully_shard_model`` + point ``optimizer``'s param groups at the shards and
    ``fully_shard_optimizer`` (the other arguments, ``offload_policy`` included, are
    ``fully_shard_model``'s). Keyword-only ``compile_units``: True or a dict of ``torch.compile``
    options compiles each unit's forward, the engine's hooks eager around it, counted in
    ``model.compile_stats`` (``fsdp_impl.compile_units``); None or False: off."""
    arguments = dict(locals())
    _check_optimizer(optimizer)
    if isinstance(module, nn.Module):
        check_not_wrapped(module)  # before the optimizer check, which would blame the optimizer
        known = {id(p) for p in module.parameters()}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                if id(p) not in known:
                    raise ValueError(f"optimizer param group {gi} holds a parameter of shape "
                                     f"{tuple(p.shape)} that is not a parameter of module; the "
                                     "optimizer's params must be the model's")
    config = _config(arguments)  # every switch checked here, before wrapping
    check_decoupled_grad_consistency(config.use_decoupled_grad, optimizer)
    if config.cuda_graph_mode:
        check_optimizer_capturable(optimizer)
    check_offload_optimizer(config.offload_policy, optimizer)
    compile_options = parse_compile_units(compile_units)  # fail before wrapping
    check_compile_units_fits(compile_options, module, config.enable_fine_grained_param_gather)
    model = _wrap(module, config, arguments)
    if compile_options is not None:
        apply_compile_units(model, compile_options)
    remap_optimizer_params(optimizer, param_mapping(model))
    # the optimizer held the user's original params until now: their memory is free only here
    release_cached_memory(model._fsdp_engine.ctx.device)
    return model, _bind_optimizer(optimizer, config.preproc_state_dict_for_dcp_ckpt)


def fully_shard_optimizer(optimizer: torch.optim.Optimizer,
                          preproc_state_dict_for_dcp_ckpt: bool = True) -> torch.optim.Optimizer:
    """Make ``optimizer`` (built on a wrapped model's ``parameters()``) reset the FSDP grad
    buffers in ``zero_grad``; returns the same object.

    ``preproc_state_dict_for_dcp_ckpt``: ``optimizer.state_dict()`` lists placeholder state for
    params that have not been stepped yet, so ``torch.distributed.checkpoint.load`` can load a
    checkpoint into a fresh optimizer (see ``fsdp_impl.dcp_optim_state``)."""
    _check_optimizer(optimizer)
    check_bool("preproc_state_dict_for_dcp_ckpt", preproc_state_dict_for_dcp_ckpt)
    return _bind_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt)


def _bind_optimizer(optimizer: torch.optim.Optimizer, preproc_state_dict_for_dcp_ckpt: bool) -> torch.optim.Optimizer:
    """``fully_shard_optimizer`` once its arguments are checked."""
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
        check_decoupled_grad_consistency(engine.config.use_decoupled_grad, optimizer)
    if preproc_state_dict_for_dcp_ckpt and not getattr(optimizer, _PLACEHOLDER_HOOK_ATTR, False):
        optimizer.register_state_dict_post_hook(PlaceholderStateHook())
        setattr(optimizer, _PLACEHOLDER_HOOK_ATTR, True)
    return attach_engines(optimizer, engines)
