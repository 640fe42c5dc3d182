"""Bad input to fully_shard fails early with a message naming the argument and allowed values;
features not implemented yet raise NotImplementedError instead of being silently ignored."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_impl import fully_shard, fully_shard_model, fully_shard_optimizer
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.models import build_model

pytestmark = [
    pytest.mark.distributed(world_size=2, timeout=300),
    pytest.mark.matrix(mesh=axes.mesh(2)),
]


def _cnn_and_adam():
    model = build_model("cnn")
    return model, torch.optim.Adam(model.parameters())


def _destroy(mesh: DeviceMesh, names) -> None:
    for name in names:
        group = mesh[name].get_group() if name else mesh.get_group()
        if group != dist.GroupMember.WORLD:
            dist.destroy_process_group(group)


@pytest.mark.parametrize("value", ["zero3", 7, "full_shard"])
def test_unknown_strategy(value, dist_env) -> None:
    with pytest.raises(ValueError, match=rf"zero_dp_strategy={value!r} is not a valid strategy; allowed "
                                         r"values: 'no_shard'/0, 'optim'/1, 'optim_grads'/2, 'optim_grads_params'/3"):
        fully_shard(*_cnn_and_adam(), zero_dp_strategy=value)


def test_unknown_outer_strategy(dist_env) -> None:
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy=2 .*allowed values: 'no_shard'/0, 'optim'/1"):
        fully_shard(*_cnn_and_adam(), outer_dp_sharding_strategy=2)


@pytest.mark.parametrize("inner", ["no_shard", "optim", "optim_grads"])
@pytest.mark.matrix(zero=matrix.param("inner", axes.zero), outer="optim")
def test_outer_optim_needs_inner_3(inner, dist_env) -> None:
    with pytest.raises(ValueError, match=r"outer_dp_sharding_strategy='optim'/1 requires "
                                         r"zero_dp_strategy='optim_grads_params'/3"):
        fully_shard(*_cnn_and_adam(), zero_dp_strategy=inner, outer_dp_sharding_strategy="optim")


def test_mesh_dim_names_that_do_not_exist(dist_env) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    with pytest.raises(ValueError, match=r"dp_shard_dim='dp' is not a dim of the device mesh; "
                                         r"allowed values: \['dp_shard'\]"):
        fully_shard(*_cnn_and_adam(), device_mesh=mesh, dp_shard_dim="dp")
    with pytest.raises(ValueError, match=r"tp_dim='tp' is not a dim"):
        fully_shard(*_cnn_and_adam(), device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp")
    with pytest.raises(ValueError, match=r"dp_outer_dim='dp_outer' is not a dim"):
        fully_shard(*_cnn_and_adam(), device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer")


def test_mesh_that_does_not_match_the_world(dist_env) -> None:
    mesh = DeviceMesh("cpu", torch.tensor([0]), mesh_dim_names=("dp_shard",))
    try:
        with pytest.raises(ValueError, match=r"device_mesh has 1 ranks .* but the world has 2"):
            fully_shard(*_cnn_and_adam(), device_mesh=mesh, dp_shard_dim="dp_shard")
    finally:
        if dist_env.rank == 0:
            _destroy(mesh, ["dp_shard"])


def test_multi_dim_mesh_needs_dp_shard_dim(dist_env) -> None:
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp_shard", "tp"))
    try:
        with pytest.raises(ValueError, match=r"dp_shard_dim must name .*allowed values: \['dp_shard', 'tp'\]"):
            fully_shard(*_cnn_and_adam(), device_mesh=mesh)
    finally:
        _destroy(mesh, ["dp_shard", "tp"])


@pytest.mark.parametrize("spec,match", [
    ([nn.GRU], r"fsdp_unit_modules=\['GRU'\] matched no submodule of SmallCNN"),
    (["torch.nn.LSTM"], r"fsdp_unit_modules=\['LSTM'\] matched no submodule"),
    (["no_such_pkg.Layer"], r"fsdp_unit_modules entry 'no_such_pkg.Layer' cannot be imported"),
    (["Linear"], r"must be an nn.Module subclass or an import path string"),
    ([int], r"must be an nn.Module subclass"),
])
def test_unit_classes_not_found(spec, match, dist_env) -> None:
    with pytest.raises(ValueError, match=match):
        fully_shard(*_cnn_and_adam(), fsdp_unit_modules=spec)


def test_unit_classes_as_import_path_strings(dist_env) -> None:
    model = fully_shard_model(build_model("cnn"), fsdp_unit_modules=["torch.nn.Conv2d", "torch.nn.Linear"])
    assert [g.name for g in model.param_and_grad_buffer.parameter_groups] == ["conv1", "conv2", "head", "<root>"]


def test_optimizer_whose_params_are_not_the_models(dist_env) -> None:
    model, other = build_model("cnn"), build_model("cnn")
    with pytest.raises(ValueError, match=r"optimizer param group 0 holds a parameter of shape \(5, 3, 3, 3\) "
                                         r"that is not a parameter of module"):
        fully_shard(model, torch.optim.Adam(other.parameters()))
    with pytest.raises(ValueError, match=r"not a parameter of a fully_shard-ed model"):
        fully_shard_optimizer(torch.optim.Adam(other.parameters()))
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer"):
        fully_shard(model, None)


def test_meta_init_rejected_for_no_shard(dist_env) -> None:
    with pytest.raises(ValueError, match=r"init_model_with_meta_device=True is not supported with "
                                         r"zero_dp_strategy='no_shard'/0"):
        fully_shard_model(build_model("cnn", device="meta"), zero_dp_strategy="no_shard",
                          init_model_with_meta_device=True)


def test_meta_tensors_without_meta_init(dist_env) -> None:
    with pytest.raises(ValueError, match=r"module has tensors on the meta device; "
                                         r"pass init_model_with_meta_device=True"):
        fully_shard_model(build_model("cnn", device="meta"))


def test_meta_module_without_reset_parameters(dist_env) -> None:
    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4))

        def forward(self, x):
            return x * self.w

    with torch.device("meta"):
        module = NoReset()
    with pytest.raises(ValueError, match=r"has meta-device tensors but no reset_parameters\(\)"):
        fully_shard_model(module, init_model_with_meta_device=True)


def test_fp8_transpose_cache_without_fp8_params_is_refused(dist_env) -> None:
    with pytest.raises(ValueError, match=r"keep_fp8_transpose_cache=True needs FP8 parameters"):
        fully_shard(*_cnn_and_adam(), keep_fp8_transpose_cache=True)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(mixed_precision_policy="bf16"), TypeError,
     r"mixed_precision_policy must be a fsdp_impl.MixedPrecisionPolicy"),
    (dict(use_decoupled_grad="yes"), TypeError, r"use_decoupled_grad must be True or False"),
    (dict(device_mesh="cpu"), TypeError, r"device_mesh must be a torch DeviceMesh or None"),
])
def test_bad_argument_types(kwargs, exc, match, dist_env) -> None:
    with pytest.raises(exc, match=match):
        fully_shard(*_cnn_and_adam(), **kwargs)


def test_module_must_be_a_module_and_not_wrapped_twice(dist_env) -> None:
    with pytest.raises(TypeError, match=r"module must be a torch.nn.Module"):
        fully_shard_model("model")
    model = fully_shard_model(build_model("cnn"))
    with pytest.raises(ValueError, match=r"already wrapped"):
        fully_shard_model(model)
    with pytest.raises(TypeError, match=r"set_model_auto_sync\(sync\) needs a bool"):
        model.set_model_auto_sync(1)
    with pytest.raises(TypeError, match=r"needs a MixedPrecisionPolicy"):
        with model.mixed_precision_context(torch.float16):
            pass


def test_mixed_dtype_unit_rejected(dist_env) -> None:
    module = build_model("cnn")
    module.head.half()
    with pytest.raises(ValueError, match=r"FSDP unit '<root>' mixes parameter dtypes"):
        fully_shard_model(module)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin2(self.lin1(x)))


class _Net(nn.Module):
    """Two ``_Block`` units (each two Linear submodules) and a root Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block())
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


@pytest.mark.parametrize("fine_grained", [False, True], ids=["per_unit_gather", "fine_grained"])
@pytest.mark.parametrize("zero", [0, 3])
@pytest.mark.matrix(zero=matrix.param("zero", axes.zero))
def test_unit_submodule_called_outside_its_unit(zero, fine_grained, dist_env) -> None:
    """A module holding a unit's params, called on its own (its params are the sharded DTensors
    then), gets an error naming it, its unit and what to do, with or without fine-grained gather
    (without, torch's ``aten.addmm.default got mixed torch.Tensor and DTensor`` came through);
    the refused calls change nothing."""
    torch.manual_seed(0)
    model = fully_shard_model(_Net(), fsdp_unit_modules=[_Block], zero_dp_strategy=zero,
                              enable_fine_grained_param_gather=fine_grained)
    x = torch.randn(3, 8)
    before = model(x).detach().clone()
    with pytest.raises(RuntimeError, match=r"^Linear holds params of FSDP unit 'blocks\.1' but ran outside that unit's "
                                           r"forward: module 'blocks\.1\.lin2' was called while its params are sharded "
                                           r"DTensors; call it from the unit's forward \(run 'blocks\.1' itself\), or "
                                           r"make it a unit of its own \(add its class to fsdp_unit_modules"):
        model.module.blocks[1].lin2(x)
    with pytest.raises(RuntimeError, match=r"^Linear holds params of FSDP unit '<root>' but ran outside that unit's "
                                           r"forward: module 'out' .*call it from the forward of the model "
                                           r"fully_shard returned"):
        model.module.out(x)
    assert torch.equal(model(x), before), "a refused call must leave the model as it was"
    model(x).sum().backward()  # and it still trains
    assert all(p.grad is not None for p in model.parameters())


def _plain_state(net: nn.Module) -> dict:
    """What a failed wrap must not change: the parameter objects, their values, every hook."""
    return {"params": [(n, p, p.to_local().clone() if hasattr(p, "to_local") else p.detach().clone())
                       for n, p in net.named_parameters()],
            "hooks": [(n, len(m._forward_pre_hooks), len(m._forward_hooks)) for n, m in net.named_modules()]}


@pytest.mark.parametrize("how", ["fully_shard_opt_before", "fully_shard_opt_after", "fully_shard_model"])
@pytest.mark.matrix(zero="optim_grads_params")
def test_wrapping_a_child_unit_then_its_parent(how, dist_env) -> None:
    """fully_shard on a submodule, then on the module holding it: the error names the module
    wrapped twice and what to do (it named the optimizer when the optimizer was built before the
    first wrap), raised before anything changes: the first wrap trains on as before."""
    torch.manual_seed(0)
    net = _Net()
    opt_all = torch.optim.Adam(net.parameters(), lr=1e-2)  # built on the original params
    child, child_opt = fully_shard(net.blocks[0], torch.optim.Adam(net.blocks[0].parameters(), lr=1e-2))
    x = torch.randn(3, 8)
    before = child(x).detach().clone()
    state = _plain_state(net)
    expected = (r"its submodule 'blocks\.0' \(_Block\) was wrapped by an earlier call \(its parameter "
                r"'blocks\.0\.lin1\.weight' is a shard owned by that model\), and a module cannot be wrapped twice; "
                r"wrap once, at the top: fully_shard the whole model with fsdp_unit_modules=\[_Block, \.\.\.\]")
    with pytest.raises(ValueError, match=expected):
        if how == "fully_shard_opt_before":
            fully_shard(net, opt_all)
        elif how == "fully_shard_opt_after":
            fully_shard(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        else:
            fully_shard_model(net)
    after = _plain_state(net)
    assert after["hooks"] == state["hooks"], "the failed wrap registered or removed hooks"
    for (name, p, value), (name2, p2, value2) in zip(state["params"], after["params"], strict=True):
        assert name == name2 and p is p2 and torch.equal(value, value2), f"the failed wrap changed {name}"
    assert torch.equal(child(x), before)
    child(x).square().sum().backward()
    child_opt.step()
    assert not torch.equal(child(x), before), "the first wrap still trains"
