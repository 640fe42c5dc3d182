"""Wrap-time checks of the module and the configuration against the mesh: they raise before any
buffer is allocated or collective issued, with a message naming the argument and what is allowed.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import FSDPConfig
from .fp8.params import check_fp8_params
from .mesh import submesh
from .module import FullyShardedModule
from .optimizer_binding import ENGINE_REF_ATTR
from .policy import ShardingStrategy


def _wrap_once(cls: str) -> str:
    return (f"wrap once, at the top: fully_shard the whole model with fsdp_unit_modules=[{cls}, ...] (each match "
            "becomes a unit of that one wrap), starting from a freshly built model, since the earlier wrap "
            "already replaced its parameters with shards")


def _owned_param_error(module: nn.Module, name: str, param: nn.Parameter) -> ValueError:
    """The error for ``module``'s parameter ``name``, a shard of an earlier wrap: which module
    that wrap took (a submodule of ``module``, or a model ``module`` is part of) and what to do."""
    ref = getattr(param, ENGINE_REF_ATTR)
    engine = ref()
    fqn = next((p.fqn for u in engine.units for p in u.params if p.sharded is param), None) if engine else None
    owned = f"its parameter {name!r} is a shard owned by that model"
    if fqn == name:  # the module inside a wrapper
        return ValueError(f"module was already wrapped by fully_shard (it is the module inside the wrapper "
                          f"fully_shard returned): {owned}; wrap the original module once")
    if fqn is not None and name.endswith("." + fqn):  # a submodule was wrapped first
        inner = name[:-len(fqn) - 1]
        cls = type(module.get_submodule(inner)).__name__
        return ValueError(f"module contains a model already wrapped by fully_shard: its submodule {inner!r} ({cls}) "
                          f"was wrapped by an earlier call ({owned}), and a module cannot be wrapped twice; "
                          + _wrap_once(cls))
    if fqn is not None and fqn.endswith("." + name):  # a part of a wrapped model
        inner = fqn[:-len(name) - 1]
        return ValueError(f"module is part of a model already wrapped by fully_shard (that model's submodule "
                          f"{inner!r}): {owned}; to shard it on its own, list its class "
                          f"({type(module).__name__}) in that wrap's fsdp_unit_modules instead of wrapping it again")
    return ValueError(f"module is (part of) a model already wrapped by fully_shard: {owned}; "
                      "wrap the original module once")


def check_not_wrapped(module: nn.Module) -> None:
    """Refuse a wrapped model, its inner module or anything containing a wrapped part: their
    params are already DTensor shards, which the checks further on would misreport as TP params
    (or, in ``fully_shard``, as params the optimizer holds but the module does not). Reads only."""
    if isinstance(module, FullyShardedModule):
        raise ValueError("module is already wrapped by fully_shard (it is the wrapper it returned); "
                         "wrap the original module once")
    for name, sub in module.named_modules():
        if isinstance(sub, FullyShardedModule):
            raise ValueError(f"module contains a model already wrapped by fully_shard (submodule {name!r}); "
                             f"fully_shard cannot be nested: " + _wrap_once(type(sub.module).__name__))
    for name, param in module.named_parameters():
        if getattr(param, ENGINE_REF_ATTR, None) is not None:
            raise _owned_param_error(module, name, param)


def validate(module: nn.Module, mesh: DeviceMesh, dp_outer_dim: str | None, tp_dim: str | None,
             config: FSDPConfig) -> None:
    """Checks that need the module and the mesh (``FSDPConfig`` checked its own values)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    check_not_wrapped(module)
    if dp_outer_dim is not None:
        submesh(mesh, dp_outer_dim, "dp_outer_dim")
    if tp_dim is not None:
        submesh(mesh, tp_dim, "tp_dim")
    strategy, outer = config.strategy, config.outer_strategy
    if outer == ShardingStrategy.OPTIM and strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
        raise ValueError(f"outer_dp_sharding_strategy='optim'/1 requires zero_dp_strategy="
                         f"'optim_grads_params'/3, got zero_dp_strategy={strategy.name.lower()!r}/{int(strategy)}")
    check_fp8_params(module, strategy, config.mixed_precision_policy, config.keep_fp8_transpose_cache)
    if config.init_model_with_meta_device and strategy == ShardingStrategy.NO_SHARD:
        raise ValueError("init_model_with_meta_device=True is not supported with zero_dp_strategy="
                         "'no_shard'/0 (every rank would hold the whole model anyway); allowed "
                         "strategies: 'optim'/1, 'optim_grads'/2, 'optim_grads_params'/3")
