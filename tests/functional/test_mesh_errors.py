"""Bad mesh input fails early with a message naming the argument and allowed values:
missing dims, a mesh that does not cover the world, dp_outer_dim / hybrid_fsdp_group given
alone, a hybrid group of the wrong size, outer 'optim' with an inner strategy other than 3, and
DTensor tensor-parallel params without a tp_dim or on a mesh that is not the tp dim. Also
``device_mesh=None`` and ``dist_index``."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_impl import fully_shard, fully_shard_model
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.collective_counter import group_ranks
from tests.functional.common.mesh import seed_kwargs, seed_mesh
from tests.functional.common.models import build_model, unit_classes

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=300),
    pytest.mark.matrix(mesh=axes.mesh(4)),
]


def _cnn():
    model = build_model("cnn")
    return model, torch.optim.Adam(model.parameters())


def _hsdp_kwargs(**overrides):
    kwargs = seed_kwargs(seed_mesh((2, 2, 1, 1)), "no_shard")
    kwargs.update(overrides)
    return kwargs


def test_dims_missing(dist_env) -> None:
    mesh = seed_mesh((2, 2, 1, 1))
    allowed = r"allowed values: \[.*'dp_outer', 'dp_shard', 'cp', 'tp'"
    with pytest.raises(ValueError, match=rf"dp_outer_dim='outer' is not a dim of the device mesh; {allowed}"):
        fully_shard(*_cnn(), **_hsdp_kwargs(dp_outer_dim="outer"))
    with pytest.raises(ValueError, match=rf"tp_dim='model' is not a dim of the device mesh; {allowed}"):
        fully_shard(*_cnn(), **_hsdp_kwargs(tp_dim="model"))
    with pytest.raises(ValueError, match=rf"dp_shard_dim='data' is not a dim of the device mesh; {allowed}"):
        fully_shard(*_cnn(), **_hsdp_kwargs(dp_shard_dim="data"))
    with pytest.raises(ValueError, match=r"dp_shard_dim must name the data-parallel shard dim of a 4-D mesh"):
        fully_shard(*_cnn(), device_mesh=mesh)


def test_mesh_size_must_match_the_world(dist_env) -> None:
    small = DeviceMesh("cpu", torch.arange(2), mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match=r"device_mesh has 2 ranks \(shape \(2,\)\) but the world has 4"):
        fully_shard(*_cnn(), device_mesh=small, dp_shard_dim="dp_shard")


def test_dp_outer_dim_and_hybrid_group_go_together(dist_env) -> None:
    with pytest.raises(ValueError, match=r"dp_outer_dim was given without hybrid_fsdp_group; HSDP needs both"):
        fully_shard(*_cnn(), **_hsdp_kwargs(hybrid_fsdp_group=None))
    with pytest.raises(ValueError, match=r"hybrid_fsdp_group was given without dp_outer_dim; HSDP needs both"):
        fully_shard(*_cnn(), **_hsdp_kwargs(dp_outer_dim=None))
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy='optim'/1 needs dp_outer_dim and "
                                         r"hybrid_fsdp_group; without them the only allowed value is 'no_shard'/0"):
        fully_shard(*_cnn(), **_hsdp_kwargs(dp_outer_dim=None, hybrid_fsdp_group=None,
                                            outer_dp_sharding_strategy="optim"))
    with pytest.raises(TypeError, match=r"hybrid_fsdp_group must be a torch.distributed.ProcessGroup"):
        fully_shard(*_cnn(), **_hsdp_kwargs(hybrid_fsdp_group=object()))


def test_hybrid_group_must_be_outer_times_shard(dist_env) -> None:
    mesh = seed_mesh((2, 2, 1, 1))
    with pytest.raises(ValueError, match=r"hybrid_fsdp_group has 2 ranks but dp_outer_dim='dp_outer' \(size 2\) "
                                         r"x dp_shard_dim='dp_shard' \(size 2\) has 4"):
        fully_shard(*_cnn(), **_hsdp_kwargs(hybrid_fsdp_group=mesh["dp_shard"].get_group()))
    with pytest.raises(ValueError, match=r"dp_outer_dim='dp_shard' must differ from dp_shard_dim='dp_shard'"):
        fully_shard(*_cnn(), **_hsdp_kwargs(dp_outer_dim="dp_shard"))
    with pytest.raises(ValueError, match=r"tp_dim='dp_outer' must differ from dp_shard_dim and dp_outer_dim"):
        fully_shard(*_cnn(), **_hsdp_kwargs(tp_dim="dp_outer"))


@pytest.mark.parametrize("inner", ["no_shard", 1, "optim_grads"])
@pytest.mark.matrix(zero=matrix.param("inner", axes.zero), outer="optim")
def test_outer_optim_needs_inner_optim_grads_params(inner, dist_env) -> None:
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy='optim'/1 requires zero_dp_strategy="
                                         r"'optim_grads_params'/3, got zero_dp_strategy="):
        fully_shard(*_cnn(), zero_dp_strategy=inner, **_hsdp_kwargs(outer_dp_sharding_strategy="optim"))


def _tp_model(mesh, dim: str = "tp") -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    torch.manual_seed(0)
    return parallelize_module(nn.Sequential(nn.Linear(4, 6)), mesh[dim], {"0": ColwiseParallel()})


def test_dtensor_tp_params_need_tp_dim(dist_env) -> None:
    mesh = seed_mesh((1, 2, 1, 2))
    kwargs = dict(seed_kwargs(mesh, None), tp_dim=None)
    with pytest.raises(ValueError, match=r"parameter '0.weight' is a DTensor on mesh dims \('tp',\).* "
                                         r"but tp_dim is None; pass tp_dim"):
        fully_shard_model(_tp_model(mesh), **kwargs)


def test_dtensor_params_must_live_on_the_tp_dim(dist_env) -> None:
    mesh = seed_mesh((1, 2, 1, 2))
    with pytest.raises(ValueError, match=r"parameter '0.weight' is a DTensor on mesh dims \('dp_shard',\).*"
                                         r"must live on the 1-D tp_dim='tp' sub-mesh"):
        fully_shard_model(_tp_model(mesh, "dp_shard"), **seed_kwargs(mesh, None))


def test_device_mesh_none_builds_1d_mesh_over_the_world(dist_env) -> None:
    model = fully_shard_model(build_model("cnn"), fsdp_unit_modules=list(unit_classes("cnn")))
    idx = model.dist_index
    assert idx.device_mesh.ndim == 1 and idx.device_mesh.device_type == dist_env.device.type
    assert group_ranks(idx.get_fsdp_group()) == tuple(range(dist.get_world_size()))
    assert idx.get_outer_fsdp_group() is None and idx.get_hybrid_fsdp_group() is None
    assert idx.get_tp_group() is None


def test_dist_index_reports_every_group(dist_env) -> None:
    mesh = seed_mesh((2, 1, 1, 2))
    model = fully_shard_model(build_model("cnn"), fsdp_unit_modules=list(unit_classes("cnn")),
                              **seed_kwargs(mesh, "no_shard"))
    idx = model.dist_index
    assert group_ranks(idx.get_fsdp_group()) == group_ranks(mesh["dp_shard"].get_group())
    assert group_ranks(idx.get_outer_fsdp_group()) == group_ranks(mesh["dp_outer"].get_group())
    assert idx.get_hybrid_fsdp_group() is mesh["hsdp"].get_group()
    assert group_ranks(idx.get_tp_group()) == group_ranks(mesh["tp"].get_group())
