"""Strategy parsing and MixedPrecisionPolicy validation (fsdp_impl.policy)."""
from __future__ import annotations

import pytest
import torch

from fsdp_impl import MixedPrecisionPolicy
from fsdp_impl.policy import ResolvedDtypes, ShardingStrategy, parse_strategy


@pytest.mark.parametrize("value,expected", [
    ("no_shard", 0), (0, 0), ("optim", 1), (1, 1), ("optim_grads", 2), (2, 2),
    ("optim_grads_params", 3), (3, 3), (ShardingStrategy.OPTIM, 1)])
def test_parse_strategy(value, expected) -> None:
    assert parse_strategy(value) == expected


@pytest.mark.parametrize("value", ["zero3", 4, -1, True, None, 2.0])
def test_parse_strategy_rejects(value) -> None:
    with pytest.raises(ValueError, match=r"zero_dp_strategy=.*allowed values: 'no_shard'/0, 'optim'/1"):
        parse_strategy(value)


def test_parse_outer_strategy_allowed_subset() -> None:
    allowed = (ShardingStrategy.NO_SHARD, ShardingStrategy.OPTIM)
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy='optim_grads'.*'no_shard'/0, 'optim'/1$"):
        parse_strategy("optim_grads", "outer_dp_sharding_strategy", allowed)


def test_policy_resolution() -> None:
    d = ResolvedDtypes.resolve(MixedPrecisionPolicy(), torch.bfloat16)
    assert (d.compute, d.main_params, d.main_grads, d.grad_comm) == (torch.bfloat16,) + (torch.float32,) * 3
    d = ResolvedDtypes.resolve(MixedPrecisionPolicy(main_params_dtype=None), torch.bfloat16)
    assert d.main_params == d.main_grads == d.grad_comm == torch.bfloat16
    d = ResolvedDtypes.resolve(MixedPrecisionPolicy(torch.float64, torch.float32, torch.float16), torch.float32)
    assert (d.main_params, d.main_grads, d.grad_comm) == (torch.float64, torch.float32, torch.float16)


def test_policy_rejects_non_float_dtype() -> None:
    with pytest.raises(ValueError, match="main_grads_dtype=torch.int32"):
        MixedPrecisionPolicy(main_grads_dtype=torch.int32)
