"""Wrap-time checks of the module and the configuration against the mesh: they raise before any
buffer is allocated or collective issued, with a message naming the argument and what is allowed.
"""
from __future__ import annotations

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .config import FSDPConfig
from .fp8_params import check_fp8_params
from .mesh import submesh
from .module import FullyShardedModule
from .optimizer_binding import ENGINE_REF_ATTR
from .policy import ShardingStrategy


def check_not_wrapped(module: nn.Module) -> None:
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
