"""Megatron-FSDP 0.6.1's ``fully_shard`` arguments, each with a parity or an error test (2 ranks).

Grad semantics are checked on the synced grads of one backward against a single-process
reference that computes the same objective on the global batch: by default and with
``average_in_collective`` the grads are the mean over ranks (the two agree to fp32 rounding),
with ``calculate_per_token_loss`` they are the sum (no division by the data-parallel size).
A factor-of-world error is 100% relative, far above the 1e-5 tolerance (the measured
difference is fp32 summation order, <= 1e-6).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp_impl import fully_shard, fully_shard_model
from fsdp_impl.config import BOOL_SWITCHES
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.cnn_grads import UNITS, assert_close, fsdp_grads, local_batch, reference_grads
from tests.functional.common.models import SmallCNN, build_model, loss_fn

pytestmark = [pytest.mark.distributed(world_size=2, timeout=300),
              pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="cnn", dtype="fp32")]

@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", ["default", "average_in_collective", "calculate_per_token_loss"])
def test_grad_reduction_modes_match_a_reference(mode: str, strategy: int, dist_env: Any) -> None:
    kwargs = {} if mode == "default" else {mode: True}
    grads = fsdp_grads(dist_env, zero_dp_strategy=strategy, **kwargs)
    reduction = "sum" if mode == "calculate_per_token_loss" else "mean"
    assert_close(grads, reference_grads(dist_env.world_size, reduction), f"{mode}, ZeRO-{strategy}")


def _losses(dist_env: Any, steps: int = 3, model: nn.Module | None = None, before: Any = None,
            **kwargs: Any) -> tuple[list[float], Any]:
    """Wrap (``kwargs`` go to ``fully_shard``), call ``before(wrapped)``, train ``steps`` Adam steps."""
    model = model if model is not None else build_model("cnn")
    fsdp, opt = fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), **kwargs)
    if before is not None:
        before(fsdp)
    losses = []
    for step in range(steps):
        x, y = local_batch(dist_env, seed=step)
        loss = loss_fn("cnn")(fsdp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, fsdp


def _pending_prefetches(fsdp: Any) -> list[bool]:
    """Per unit: is an all-gather started ahead of its forward (a prefetch) in flight?"""
    return [u._gather is not None for u in fsdp._fsdp_engine.units]


@pytest.mark.parametrize("overlap", [True, False])
def test_overlap_switches(overlap: bool, dist_env: Any) -> None:
    """Off: collectives on the compute stream and no ZeRO-3 prefetch; the numbers do not change."""
    baseline, _ = _losses(dist_env, fsdp_unit_modules=UNITS)
    seen: list[bool] = []

    def watch(fsdp: Any) -> None:  # these hooks run after the engine's pre-forward
        for m in (fsdp.module.conv1, fsdp.module.conv2, fsdp.module.head):
            m.register_forward_pre_hook(lambda mod, args: seen.append(any(_pending_prefetches(fsdp))))

    losses, fsdp = _losses(dist_env, fsdp_unit_modules=UNITS, overlap_grad_reduce=overlap,
                           overlap_param_gather=overlap, before=watch)
    assert losses == baseline
    assert any(seen) == overlap, f"prefetches seen: {seen}"
    if dist_env.device.type == "cuda":
        streams = fsdp._fsdp_engine.ctx.streams
        assert (streams.gather._stream is not None) == overlap and (streams.reduce._stream is not None) == overlap


def test_device_argument(dist_env: Any) -> None:
    baseline, _ = _losses(dist_env, fsdp_unit_modules=UNITS)
    for device in (dist_env.device, str(dist_env.device), None):
        losses, fsdp = _losses(dist_env, fsdp_unit_modules=UNITS, device=device)
        assert losses == baseline and fsdp._fsdp_engine.ctx.device.type == dist_env.device.type
    with pytest.raises(ValueError, match=r"device='meta' does not match the device mesh, whose device type is "
                                         rf"'{dist_env.device.type}'; allowed values: None or a"):
        fully_shard_model(build_model("cnn"), device=torch.device("meta"))
    with pytest.raises(TypeError, match=r"device must be a torch.device, a device string or None, got 2.5"):
        fully_shard_model(build_model("cnn"), device=2.5)


@pytest.mark.matrix(zero=matrix.param("kwargs", lambda kw: axes.zero(kw.get("zero_dp_strategy", 3))))
@pytest.mark.parametrize("kwargs", [dict(disable_bucketing=True), dict(fsdp_db_use_persist_buf_on_alloc_fail=True),
                                    dict(disable_symmetric_registration=True),
                                    dict(fsdp_double_buffer=True, zero_dp_strategy=1),
                                    dict(maxpool_double_buffer=True, zero_dp_strategy=2)],
                         ids=["disable_bucketing", "persist_buf", "no_symmetric", "double_buffer_z1", "maxpool_z2"])
def test_switches_without_numerical_effect_here(kwargs: dict, dist_env: Any) -> None:
    """The root unit is already one bucket; the pool has nothing to hold with persistent compute
    params (ZeRO-0/1/2) and fits every unit; symmetric registration only modifies nccl_ub."""
    strategy = kwargs.pop("zero_dp_strategy", 3)
    baseline, ref = _losses(dist_env, fsdp_unit_modules=UNITS, zero_dp_strategy=strategy)
    losses, fsdp = _losses(dist_env, fsdp_unit_modules=UNITS, zero_dp_strategy=strategy, **kwargs)
    assert losses == baseline
    assert [u.name for u in fsdp._fsdp_engine.units] == [u.name for u in ref._fsdp_engine.units]


@pytest.mark.parametrize("flag", ["fsdp_double_buffer", "maxpool_double_buffer"])
def test_double_buffer_pools_zero3_units_with_identical_training(flag: str, dist_env: Any) -> None:
    """ZeRO-3 units gather into a 2-slot pool (fixed storage shared by the units) and train exactly
    like per-unit storage: the pool only changes where the compute params live."""
    baseline, _ = _losses(dist_env, fsdp_unit_modules=UNITS, zero_dp_strategy=3)
    losses, fsdp = _losses(dist_env, fsdp_unit_modules=UNITS, zero_dp_strategy=3, **{flag: True})
    assert losses == baseline
    pooled = [type(u.storage).__name__ for u in fsdp._fsdp_engine.units[:-1] if u.params]
    assert pooled and set(pooled) == {"PooledStorage"}, pooled


def test_nccl_ub_off_nccl_names_the_backend(dist_env: Any) -> None:
    """NCCL user buffers need NCCL: on another backend, a clear error before anything is built."""
    if dist_env.backend != "gloo":
        pytest.skip("this checks the error on gloo; tests/functional/test_nccl_ub*.py cover NCCL")
    with pytest.raises(ValueError, match=r"nccl_ub=True \(NCCL user-buffer registration of the FSDP buffers\): it "
                                         r"needs the NCCL backend \(this process group uses 'gloo'\)"):
        fully_shard_model(build_model("cnn"), nccl_ub=True)


@pytest.mark.parametrize("name", BOOL_SWITCHES)
def test_every_switch_must_be_a_bool(name: str, dist_env: Any) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be True or False, got 'yes'"):
        fully_shard_model(build_model("cnn"), **{name: "yes"})


def test_fsdp_group_ag_carries_the_param_all_gathers(dist_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    ag = dist.new_group(list(range(dist_env.world_size)))
    groups: list[Any] = []
    real = dist.all_gather_into_tensor

    def record(output: torch.Tensor, local: torch.Tensor, group: Any = None, **kw: Any) -> Any:
        groups.append(group)
        return real(output, local, group=group, **kw)

    baseline, _ = _losses(dist_env, fsdp_unit_modules=UNITS)
    monkeypatch.setattr(dist, "all_gather_into_tensor", record)
    losses, fsdp = _losses(dist_env, fsdp_unit_modules=UNITS, fsdp_group_ag=ag)
    monkeypatch.undo()
    assert losses == baseline
    assert groups and all(g is ag for g in groups), "every param all-gather must run on fsdp_group_ag"
    assert fsdp.dist_index.get_fsdp_group(independent_all_gather=True) is ag
    assert fsdp.dist_index.get_fsdp_group() is not ag


def test_fsdp_group_ag_must_match_the_gather_group(dist_env: Any) -> None:
    lone = dist.new_group([0])
    with pytest.raises(ValueError, match=r"fsdp_group_ag must hold the same ranks, in the same order, as the group "
                                         r"the params are gathered over \(\[0, 1\] on this rank\)"):
        fully_shard_model(build_model("cnn"), fsdp_group_ag=lone)
    with pytest.raises(TypeError, match=r"fsdp_group_ag must be a torch.distributed.ProcessGroup or None, got str"):
        fully_shard_model(build_model("cnn"), fsdp_group_ag="ag")


@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
@pytest.mark.parametrize("strategy", [1, 3])
def test_root_class_listed_in_unit_modules_makes_one_unit(strategy: int, dist_env: Any) -> None:
    """As in Megatron-FSDP: the whole model is one unit, gathered before the root's forward."""
    baseline, _ = _losses(dist_env, zero_dp_strategy=strategy)
    for units in ([SmallCNN], [SmallCNN, nn.Conv2d], ["tests.functional.common.models.SmallCNN"]):
        losses, fsdp = _losses(dist_env, zero_dp_strategy=strategy, fsdp_unit_modules=units)
        assert [u.name for u in fsdp._fsdp_engine.units] == ["<root>"], units
        assert losses == baseline, units


def test_device_mesh_none_takes_megatron_dim_names(dist_env: Any) -> None:
    model = fully_shard_model(build_model("cnn"), dp_shard_dim="fsdp", tp_dim="tp", fsdp_unit_modules=UNITS)
    mesh = model.dist_index.device_mesh
    assert mesh.mesh_dim_names == ("fsdp", "tp") and tuple(mesh.shape) == (dist_env.world_size, 1)
    assert model.dist_index.get_dp_group().size() == dist_env.world_size
    assert model.dist_index.get_fsdp_group(is_expert_parallel=True) is None  # no expert mesh


@pytest.mark.parametrize("preproc", [True, False])
def test_plain_dcp_resume_into_a_fresh_optimizer(preproc: bool, dist_env: Any, shared_tmp_path: Path) -> None:
    """Megatron-FSDP users' resume: ``dcp.save`` of the state dicts, then a fresh
    ``fully_shard`` and ``dcp.load`` into its state dicts. With the placeholder state
    (``preproc_state_dict_for_dcp_ckpt=True``) the optimizer state comes back; without it a fresh
    optimizer has no state for DCP to fill, as in plain torch."""
    def wrap(seed: int) -> tuple[Any, torch.optim.Optimizer]:
        model = build_model("cnn", seed=seed)
        return fully_shard(model, torch.optim.Adam(model.parameters(), lr=1e-2), fsdp_unit_modules=UNITS,
                           preproc_state_dict_for_dcp_ckpt=preproc)

    model, opt = wrap(0)
    x, y = local_batch(dist_env)
    loss_fn("cnn")(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    saved_model = {k: v.full_tensor() for k, v in model.state_dict().items()}
    saved_opt = {i: {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in s.items()}
                 for i, s in opt.state_dict()["state"].items()}
    dcp.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(shared_tmp_path))
    fresh, fresh_opt = wrap(1)
    state = {"model": fresh.state_dict(), "optimizer": fresh_opt.state_dict()}
    assert len(state["optimizer"]["state"]) == (len(saved_opt) if preproc else 0)
    dcp.load(state, checkpoint_id=str(shared_tmp_path))
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optimizer"])
    assert all(torch.equal(v.full_tensor(), saved_model[k]) for k, v in fresh.state_dict().items())
    loaded = fresh_opt.state_dict()["state"]
    if not preproc:
        assert loaded == {}
        return
    for i, entry in saved_opt.items():
        for k, v in entry.items():
            got = loaded[i][k]
            assert torch.equal(got.full_tensor() if isinstance(got, DTensor) else got, v), (i, k)
    assert all(len(s) == 0 for s in wrap(2)[1].state.values())  # placeholders never enter optimizer.state
