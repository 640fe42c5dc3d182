"""Mixed-precision policy and ZeRO strategy parsing.

Kept free of distributed state so both can be unit-tested and validated before any
collective runs (bad input must fail early, on every rank, with the same message).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class ShardingStrategy(enum.IntEnum):
    """ZeRO stage: what is sharded across the dp-shard group."""

    NO_SHARD = 0  # nothing sharded; grads all-reduced once per optimisation cycle
    OPTIM = 1  # optimizer state (main params) sharded; grads reduce-scattered once per cycle
    OPTIM_GRADS = 2  # + grads reduce-scattered every backward
    OPTIM_GRADS_PARAMS = 3  # + compute params all-gathered per unit and freed after use


_STRATEGY_NAMES = {
    "no_shard": ShardingStrategy.NO_SHARD,
    "optim": ShardingStrategy.OPTIM,
    "optim_grads": ShardingStrategy.OPTIM_GRADS,
    "optim_grads_params": ShardingStrategy.OPTIM_GRADS_PARAMS,
}


def parse_strategy(value: str | int | ShardingStrategy, arg_name: str = "zero_dp_strategy",
                   allowed: tuple | None = None) -> ShardingStrategy:
    """Turn a strategy name or number into a ShardingStrategy, or raise naming the argument."""
    allowed = allowed or tuple(ShardingStrategy)
    choices = ", ".join(f"'{n}'/{int(s)}" for n, s in _STRATEGY_NAMES.items() if s in allowed)
    strategy: ShardingStrategy | None = None
    if isinstance(value, str) and value in _STRATEGY_NAMES:
        strategy = _STRATEGY_NAMES[value]
    elif isinstance(value, int) and not isinstance(value, bool) and value in set(int(s) for s in ShardingStrategy):
        strategy = ShardingStrategy(value)
    if strategy is None or strategy not in allowed:
        raise ValueError(f"{arg_name}={value!r} is not a valid strategy; allowed values: {choices}")
    return strategy


_FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def check_bool(name: str, value: object) -> None:
    """The one check of a boolean switch: ``name`` is the argument the user passed."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _check_dtype(name: str, value: torch.dtype | None) -> None:
    if value is not None and value not in _FLOAT_DTYPES:
        raise ValueError(f"MixedPrecisionPolicy.{name}={value!r} is not supported; allowed values: "
                         f"None, {', '.join(str(d) for d in _FLOAT_DTYPES)}")


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of the FSDP buffers.

    - ``main_params_dtype``: dtype of the sharded main weights the optimizer updates (e.g. fp32
      master weights for a bf16 model); ``None`` keeps the module's own dtype (no extra copy).
    - ``main_grads_dtype``: dtype grads are accumulated in; ``None`` = main params dtype.
    - ``grad_comm_dtype``: dtype grads are reduced in; ``None`` = main grads dtype.
    Compute always happens in the module's dtype (cast the module before wrapping).
    """

    main_params_dtype: torch.dtype | None = torch.float32
    main_grads_dtype: torch.dtype | None = None
    grad_comm_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        _check_dtype("main_params_dtype", self.main_params_dtype)
        _check_dtype("main_grads_dtype", self.main_grads_dtype)
        _check_dtype("grad_comm_dtype", self.grad_comm_dtype)


@dataclass(frozen=True)
class ResolvedDtypes:
    """The concrete dtypes of one unit once the module dtype is known."""

    compute: torch.dtype
    main_params: torch.dtype
    main_grads: torch.dtype
    grad_comm: torch.dtype

    @staticmethod
    def resolve(policy: MixedPrecisionPolicy, compute: torch.dtype) -> ResolvedDtypes:
        main_params = policy.main_params_dtype or compute
        main_grads = policy.main_grads_dtype or main_params
        return ResolvedDtypes(compute, main_params, main_grads, policy.grad_comm_dtype or main_grads)
