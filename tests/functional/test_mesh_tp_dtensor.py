"""Tensor-parallel DTensor params (``parallelize_module`` on the tp sub-mesh) composed with FSDP.

A small residual MLP whose blocks are column-parallel (``w1``: weight and bias ``Shard(0)`` on tp)
then row-parallel (``w2``: weight ``Shard(1)``, bias ``Replicate()``), plus plain (TP-replicated)
input/output layers and LayerNorms. Every case checks against a single-process copy of the same
network trained on the union of the samples of the data-parallel ranks (TP ranks see the same
samples):
- the sharded params describe exactly the original tensors (``full_tensor()`` equals the
  pre-wrap values: a wrong placement, e.g. ``Shard(0)`` where ``_StridedShard`` is needed,
  permutes rows and fails here);
- sharded params are DTensors over (dp dims..., tp) with the expected placements;
- grads after the first sync (per tensor, rtol 1e-5) and every step's loss (1e-5) and params
  (1e-4) over 3 steps of 2 microbatches (no sync, then sync).
Measured on CPU (gloo, torch 2.13): errors <= ~3e-7.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_impl
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.mesh import data_group, data_position, seed_kwargs, seed_mesh
from tests.functional.common.numerics import max_loss_error, relative_error
from tests.functional.common.training import train_accumulating

D, H, STEPS, MICRO, LOCAL = 8, 12, 3, 2, 4
LOSS_RTOL, GRAD_RTOL, PARAM_RTOL = 1e-5, 1e-5, 1e-4
pytestmark = pytest.mark.matrix(model="tp_net", dtype="fp32")


class TPBlock(nn.Module):
    """Pre-norm residual MLP block: the column-/row-parallel pair TP frameworks use."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.w1 = nn.Linear(D, H)
        self.w2 = nn.Linear(H, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class TPNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList([TPBlock(), TPBlock()])
        self.out = nn.Linear(D, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _build(mesh: Any, meta: bool, seed: int = 0) -> tuple[nn.Module, dict[str, torch.Tensor] | None]:
    """The TP model and (eager init only) its full params before wrapping."""
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = TPNet()
    original = None if meta else {n: p.detach().clone() for n, p in model.named_parameters()}
    if not meta:
        model = model.to(mesh.device_type)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    return model, original


def _batch(step: int, micro: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(size * LOCAL, 5, generator=g), torch.randn(size * LOCAL, 3, generator=g)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach().cpu() if isinstance(t, DTensor) else t.detach().cpu()


def _check_placements(model: nn.Module, mesh: Any, outer: str | None, strategy: int) -> None:
    """w1 (column-parallel) is strided over dp, w2.weight row-parallel, w2.bias replicated on tp."""
    tp = mesh["tp"].size()
    dp_kind = Replicate if strategy == 0 else Shard
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        if ".w1." in name or ".w2." in name:
            assert p.device_mesh.mesh_dim_names[-1] == "tp", f"{name}: mesh {p.device_mesh}"
            tp_placement = p.placements[-1]
            expected = Replicate() if name.endswith("w2.bias") else Shard(1 if "w2" in name else 0)
            assert tp_placement == expected, f"{name}: {p.placements}"
            dp = p.placements[-2]
            strided = strategy != 0 and tp > 1 and expected == Shard(0)
            assert (type(dp).__name__ == "_StridedShard") == strided, f"{name}: {p.placements}"
            assert strided or isinstance(dp, dp_kind), f"{name}: {p.placements}"
        else:
            assert "tp" not in p.device_mesh.mesh_dim_names, f"{name}: plain params stay off tp"
        if outer == "no_shard":
            assert p.placements[0] == Replicate() and p.device_mesh.mesh_dim_names[0] == "dp_outer", name


def _train_reference(ref: nn.Module, size: int) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    losses, params, grads0 = [], [], None
    for step in range(STEPS):
        total = 0.0
        for m in range(MICRO):
            x, y = _batch(step, m, size)
            loss = nn.functional.mse_loss(ref(x), y) / MICRO
            loss.backward()
            total += loss.item()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in ref.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(total)
        params.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return losses, grads0, params


def _wrap(mesh: Any, strategy: int, outer: str | None, meta: bool = False, seed: int = 0) -> tuple:
    model, original = _build(mesh, meta, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fsdp_model, opt = fsdp_impl.fully_shard(
        model, opt, fsdp_unit_modules=[TPBlock], zero_dp_strategy=strategy,
        init_model_with_meta_device=meta, **seed_kwargs(mesh, outer))
    return fsdp_model, opt, original


def _train(fsdp_model: nn.Module, opt: Any, mesh: Any, outer: str | None, device: torch.device,
           first: int, steps: int, before_step: Callable[[int], None] | None = None) -> list[float]:
    """Steps ``first``.. of MICRO microbatches (no sync, then sync) on this rank's slice; the
    global losses."""
    pos, size = data_position(data_group(mesh, outer))

    def microbatches(step: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        out = []
        for m in range(MICRO):
            x, y = _batch(step, m, size)
            x, y = (t[pos * LOCAL:(pos + 1) * LOCAL].to(device) for t in (x, y))
            out.append(([x], y))
        return out

    return train_accumulating(fsdp_model, opt, steps, microbatches, nn.functional.mse_loss, device,
                              first=first, before_step=before_step)


def run_case(dist_env: Any, shape: tuple[int, int, int, int], strategy: int, outer: str | None,
             meta: bool = False) -> dict[str, float]:
    mesh = seed_mesh(shape, dist_env.device.type)
    fsdp_model, opt, original = _wrap(mesh, strategy, outer, meta)
    _check_placements(fsdp_model.module, mesh, outer, strategy)
    initial = {n: _full(p) for n, p in fsdp_model.module.named_parameters()}
    errors = {"init": 0.0, "loss": 0.0, "grad": 0.0, "param": 0.0}
    if original is not None:  # the sharded DTensors describe the original tensors exactly
        errors["init"] = max(relative_error(initial[n], original[n]) for n in original)
        assert errors["init"] == 0.0, "sharded params do not reassemble to the original model"
    ref = TPNet()
    ref.load_state_dict(initial)
    ref_losses, ref_grads0, ref_params = _train_reference(ref, data_position(data_group(mesh, outer))[1])

    def check_grads(step: int) -> None:
        if step == 0:
            for n, p in fsdp_model.module.named_parameters():
                assert p.grad is not None, f"{n}: no grad after the sync microbatch"
                errors["grad"] = max(errors["grad"], relative_error(_full(p.grad), ref_grads0[n]))

    for step in range(STEPS):
        loss = _train(fsdp_model, opt, mesh, outer, dist_env.device, step, 1, check_grads)[0]
        errors["loss"] = max(errors["loss"], max_loss_error([loss], [ref_losses[step]]))
        for n, p in fsdp_model.module.named_parameters():
            errors["param"] = max(errors["param"], relative_error(_full(p), ref_params[step][n]))
    print(f"[measure] tp-dtensor shape={shape} strategy={strategy} outer={outer} meta={meta} {errors}")
    assert errors["loss"] <= LOSS_RTOL, errors
    assert errors["grad"] <= GRAD_RTOL, errors
    assert errors["param"] <= PARAM_RTOL, errors
    return errors


@pytest.mark.distributed(world_size=4, timeout=600, bucket="mesh_tp_dtensor4")
@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.matrix(mesh=axes.mesh(2, tp=2), zero=matrix.param("strategy", axes.zero))
def test_tp_dtensor_with_fsdp(strategy: int, dist_env: Any) -> None:
    run_case(dist_env, (1, 2, 1, 2), strategy, None)


@pytest.mark.distributed(world_size=4, timeout=600, bucket="mesh_tp_dtensor4")
@pytest.mark.parametrize("outer,strategy", [("no_shard", 3), ("no_shard", 1), ("optim", 3)])
@pytest.mark.matrix(mesh=axes.mesh(1, outer=2, tp=2), zero=matrix.param("strategy", axes.zero),
                    outer=matrix.param("outer", axes.outer))
def test_tp_dtensor_with_hsdp_and_hfsdp(outer: str, strategy: int, dist_env: Any) -> None:
    run_case(dist_env, (2, 1, 1, 2), strategy, outer)


@pytest.mark.distributed(world_size=4, timeout=600, bucket="mesh_tp_dtensor4")
@pytest.mark.matrix(mesh=axes.mesh(2, tp=2), zero="optim_grads_params")
def test_tp_dtensor_meta_init(dist_env: Any) -> None:
    run_case(dist_env, (1, 2, 1, 2), 3, None, meta=True)


@pytest.mark.distributed(world_size=2, timeout=600, bucket="mesh_tp_dtensor2")
@pytest.mark.parametrize("strategy", [0, 3])
@pytest.mark.matrix(mesh=axes.mesh(1, tp=2), zero=matrix.param("strategy", axes.zero))
def test_tp_dtensor_world2(strategy: int, dist_env: Any) -> None:
    """TP=2 only (dp size 1): the 2-GPU NCCL subset of this file."""
    run_case(dist_env, (1, 1, 1, 2), strategy, None)


@pytest.mark.distributed(world_size=4, timeout=600, bucket="mesh_tp_dtensor4")
@pytest.mark.parametrize("load_strategy", [3, 1])
@pytest.mark.matrix(mesh=axes.mesh(2, tp=2), zero=matrix.param("load_strategy", axes.zero))
def test_tp_dtensor_checkpoint_resume(load_strategy: int, dist_env: Any, shared_tmp_path: Any) -> None:
    """Save after step 0 and resume in a fresh model (other init seed, maybe another ZeRO
    strategy): steps 1-2 reproduce the uninterrupted run (bit-exact for the same strategy; a
    different strategy reduces in another order, so 1e-6)."""
    from fsdp_impl import checkpoint

    mesh = seed_mesh((1, 2, 1, 2), dist_env.device.type)
    model, opt, _ = _wrap(mesh, 3, None)
    _train(model, opt, mesh, None, dist_env.device, 0, 1)
    checkpoint.save(shared_tmp_path / "tp", model, opt)
    expected = _train(model, opt, mesh, None, dist_env.device, 1, 2)
    final = {n: _full(p) for n, p in model.module.named_parameters()}
    resumed, ropt, _ = _wrap(mesh, load_strategy, None, seed=1)
    checkpoint.load(shared_tmp_path / "tp", resumed, ropt)
    got = _train(resumed, ropt, mesh, None, dist_env.device, 1, 2)
    worst = max(relative_error(_full(p), final[n]) for n, p in resumed.module.named_parameters())
    print(f"[measure] tp-dtensor resume strategy 3 -> {load_strategy}: losses {expected} vs {got}, "
          f"param error {worst:.3g}")
    if load_strategy == 3:
        assert got == expected and worst == 0.0
    else:
        assert max_loss_error(got, expected) <= 1e-6 and worst <= 1e-6


@pytest.mark.distributed(world_size=4, timeout=300, bucket="mesh_tp_dtensor4")
@pytest.mark.matrix(mesh=axes.mesh(2, tp=2), zero="optim_grads_params")
def test_nan_on_one_tp_rank_raises_on_every_rank(dist_env: Any) -> None:
    """TP peers hold different grads: a NaN only on TP rank 0's (plain, TP-replicated) input layer
    must still make every rank raise, or TP rank 1 would run on into collectives alone (hang)."""
    mesh = seed_mesh((1, 2, 1, 2), dist_env.device.type)
    model, _ = _build(mesh, False)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    fsdp_model, opt = fsdp_impl.fully_shard(model, opt, fsdp_unit_modules=[TPBlock], zero_dp_strategy=3,
                                            report_nan_in_param_grad=True, **seed_kwargs(mesh, None))
    poison = mesh["tp"].get_local_rank() == 0
    x, y = _batch(0, 0, 1)
    hidden = fsdp_model.module.inp
    handle = hidden.register_forward_hook(
        lambda mod, args, out: out.register_hook(lambda g: g * float("nan")) and None if poison else None)
    with pytest.raises(RuntimeError, match=r"NaN found in the gradient of parameter\(s\) \['inp.weight', 'inp.bias'\]"):
        nn.functional.mse_loss(fsdp_model(x.to(dist_env.device)), y.to(dist_env.device)).backward()
    handle.remove()
    dist.barrier()  # every rank got here: none is stuck in a collective
