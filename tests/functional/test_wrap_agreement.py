"""Wrap-time errors that used to hang or mislead: ranks that disagree on the configuration or the
model, mesh dims given by index, and wrapping what is already wrapped.

Disagreeing ranks used to issue different collectives and hang until the backend's timeout (or
abort in gloo); now one small all-reduce at wrap time finds the difference and every rank raises
the same error naming it. The short timeout makes a regression fail fast instead of hanging.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_impl import fully_shard, fully_shard_model
from fsdp_impl.agreement import check_ranks_agree, digest
from tests.functional import matrix_axes as axes
from tests.functional.common.models import build_model

pytestmark = [pytest.mark.distributed(world_size=2, timeout=120),
              pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="cnn", dtype="fp32")]


def _cnn_and_adam(**kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build_model("cnn", **kwargs)
    return model, torch.optim.Adam(model.parameters())


def _same_error_on_every_rank(message: str) -> None:
    """Every rank raised, and with the identical text (also proves the group is still usable)."""
    messages: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, message)
    assert len(set(messages)) == 1, messages


def test_ranks_with_different_strategies_fail_together(dist_env: Any) -> None:
    strategy = 3 if dist_env.rank == 0 else "optim_grads"
    with pytest.raises(ValueError, match="different arguments or models on different ranks") as err:
        fully_shard(*_cnn_and_adam(), zero_dp_strategy=strategy)
    text = str(err.value)
    assert "zero_dp_strategy differs (rank 0: \"'optim_grads_params'/3\"; rank 1: \"'optim_grads'/2\")" in text
    assert "parameters" not in text  # only what differs is named
    _same_error_on_every_rank(text)


def test_ranks_with_different_models_name_the_first_differing_param(dist_env: Any) -> None:
    hidden = 5 if dist_env.rank == 0 else 6
    with pytest.raises(ValueError, match="different arguments or models") as err:
        fully_shard(*_cnn_and_adam(hidden=hidden))
    text = str(err.value)
    assert ("parameters (name, shape, dtype, requires_grad, expert) differ at entry 0 "
            "(rank 0: ('conv1.weight', (5, 3, 3, 3), 'float32', True, False); "
            "rank 1: ('conv1.weight', (6, 3, 3, 3), 'float32', True, False)); "
            "entries per rank: ranks [0, 1]: 6") in text
    _same_error_on_every_rank(text)


def test_ranks_with_different_unit_modules_or_flags(dist_env: Any) -> None:
    units = [nn.Conv2d] if dist_env.rank == 0 else [nn.Linear]
    with pytest.raises(ValueError, match=r"fsdp_unit_modules differs \(rank 0: \('torch.nn.modules.conv.Conv2d',\); "
                                         r"rank 1: \('torch.nn.modules.linear.Linear',\)\)"):
        fully_shard(*_cnn_and_adam(), fsdp_unit_modules=units)
    with pytest.raises(ValueError, match=r"flags differs \(rank 0: \{.*'report_nan_in_param_grad': False"):
        fully_shard(*_cnn_and_adam(), report_nan_in_param_grad=dist_env.rank == 1)


def test_agreeing_ranks_pass_and_digest_is_process_independent(dist_env: Any) -> None:
    check_ranks_agree([("a", 1), ("b", [("x", (2, 3))])], dist_env.device)
    assert digest(("x", (2, 3), "float32")) == 4476701809900012717  # stable: not Python's salted hash()
    assert 0 <= digest("anything") < 1 << 62


@pytest.mark.parametrize("arg", ["dp_shard_dim", "dp_outer_dim", "tp_dim"])
def test_mesh_dim_given_as_an_index(arg: str, dist_env: Any) -> None:
    mesh = init_device_mesh(dist_env.device.type, (2, 1), mesh_dim_names=("dp_shard", "tp"))
    kwargs: dict[str, Any] = {"device_mesh": mesh, "dp_shard_dim": "dp_shard", arg: 0}
    with pytest.raises(TypeError, match=rf"{arg} must name a dim of the device mesh \(a str\), got 0 of type int; "
                                        r"allowed values: \['dp_shard', 'tp'\] or None"):
        fully_shard(*_cnn_and_adam(), **kwargs)


def test_dp_shard_dim_index_without_a_mesh(dist_env: Any) -> None:
    with pytest.raises(TypeError, match=r"dp_shard_dim must name a dim of the device mesh \(a str\), got 0 of "
                                        r"type int; allowed values: a str or None"):
        fully_shard(*_cnn_and_adam(), dp_shard_dim=0)


def test_wrapping_a_wrapped_model_or_its_parts(dist_env: Any) -> None:
    model = fully_shard_model(build_model("cnn"), fsdp_unit_modules=[nn.Conv2d])
    with pytest.raises(ValueError, match=r"already wrapped by fully_shard \(it is the wrapper it returned\)"):
        fully_shard_model(model)
    with pytest.raises(ValueError, match=r"parameter 'conv1.weight' is a shard owned by that model"):
        fully_shard_model(model.module)
    with pytest.raises(ValueError, match=r"parameter 'weight' is a shard owned by that model"):
        fully_shard_model(model.module.conv2)
    with pytest.raises(ValueError, match=r"contains a model already wrapped by fully_shard \(submodule 'inner'\)"):
        fully_shard_model(nn.ModuleDict({"inner": model}))
