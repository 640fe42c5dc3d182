"""Expert parallelism (4 ranks, EP 2) and the grad reduction modes under HSDP/HFSDP, against a
single-process reference.

The MoE model: each rank holds half the experts (EP rank ``p`` holds experts ``[2p, 2p+1]`` of
4); a top-1 router picks an expert per token; tokens reach their expert's rank through an
all-gather over the EP group, and the gated expert outputs come back through a sum over it (each
with its exact backward), so the model computes on 4 ranks exactly what one process computes
with all experts on the concatenated batch. Expert params (``.experts.`` in their names) shard
over the expert-data-parallel group (ranks with the same EP rank: ``{0, 2}``, ``{1, 3}``), the
rest over all 4 ranks. The check that matters is the grads' scale: an expert grad must be
summed over the expert-data-parallel group and divided by the *whole* data-parallel size (4):
averaging over its own group (2) would double it, which SGD turns into a 100% error.

Tolerance 1e-5 relative per tensor: fp32, only the summation order differs (measured <= 1e-6).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_impl import checkpoint, fully_shard, fully_shard_model
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.cnn_grads import assert_close, fsdp_grads, reference_grads

pytestmark = [pytest.mark.distributed(world_size=4, timeout=300),
              pytest.mark.matrix(mesh=axes.mesh(4), zero="optim_grads_params", model="tiny_moe", dtype="fp32")]

D, EXPERTS, EP, TOKENS = 6, 4, 2, 5


class _GatherEP(torch.autograd.Function):
    """Concatenate every EP rank's rows; backward: the sum of every rank's grad, own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _SumEP(torch.autograd.Function):
    """Sum over the EP ranks (each holds some experts' outputs); backward: the summed grad."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        y = y.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x))


class MoEBlock(nn.Module):
    """Top-1 MoE with a residual; ``ep_group=None`` holds every expert (the reference)."""

    def __init__(self, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.ep_group = ep_group
        local = EXPERTS if ep_group is None else EXPERTS // EP
        self.first = 0 if ep_group is None else dist.get_rank(ep_group) * local
        self.router = nn.Linear(D, EXPERTS, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, choice = torch.softmax(self.router(x), dim=-1).max(dim=-1)
        xs, gates, choices = x, gate, choice
        if self.ep_group is not None:
            xs, gates = _GatherEP.apply(x, self.ep_group), _GatherEP.apply(gate, self.ep_group)
            parts = [torch.empty_like(choice) for _ in range(EP)]
            dist.all_gather(parts, choice, group=self.ep_group)
            choices = torch.cat(parts)
        out = torch.zeros_like(xs)
        for j, expert in enumerate(self.experts):
            routed = (choices == self.first + j)[:, None]
            out = out + torch.where(routed, gates[:, None] * expert(xs), torch.zeros_like(xs))
        if self.ep_group is not None:
            rank = dist.get_rank(self.ep_group)
            out = _SumEP.apply(out, self.ep_group)[rank * x.shape[0]:(rank + 1) * x.shape[0]]
        return x + out


class TinyMoE(nn.Module):
    def __init__(self, ep_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(4, D)
        self.blocks = nn.ModuleList(MoEBlock(ep_group) for _ in range(2))
        self.head = nn.Linear(D, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _reference_name(name: str, ep_rank: int) -> str:
    """The reference's name of an EP rank's local param (local expert j is global 2p + j)."""
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(ep_rank * (EXPERTS // EP) + int(parts[i]))
    return ".".join(parts)


def _models(ep_group: dist.ProcessGroup, ep_rank: int) -> tuple[TinyMoE, TinyMoE]:
    torch.manual_seed(0)
    reference = TinyMoE()
    local = TinyMoE(ep_group)
    ref_params = dict(reference.named_parameters())
    with torch.no_grad():
        for name, p in local.named_parameters():
            p.copy_(ref_params[_reference_name(name, ep_rank)])
    return reference, local


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(TOKENS, 4, generator=g), torch.randn(TOKENS, 2, generator=g)


def _reference_step(model: TinyMoE, opt: torch.optim.Optimizer, step: int, world: int) -> None:
    """The data-parallel objective: the mean over ranks of each rank's loss."""
    losses = [nn.functional.mse_loss(model(x), y) for x, y in (_batch(step, r) for r in range(world))]
    (torch.stack(losses).sum() / world).backward()
    opt.step()
    opt.zero_grad()


def _ep_meshes(hsdp: bool, device: str) -> tuple[dict[str, Any], dist.ProcessGroup, int]:
    """fully_shard's mesh arguments, the EP group and this rank's EP rank. The expert mesh has
    the same dim names; its dp_shard (x dp_outer) dims cover the ranks with the same EP rank."""
    if not hsdp:
        mesh = init_device_mesh(device, (4,), mesh_dim_names=("dp_shard",))
        expt = init_device_mesh(device, (2, EP), mesh_dim_names=("dp_shard", "ep"))
        kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", expt_device_mesh=expt)
    else:
        mesh = init_device_mesh(device, (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
        expt = init_device_mesh(device, (2, 1, EP), mesh_dim_names=("dp_outer", "dp_shard", "ep"))
        kwargs = dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer", expt_device_mesh=expt,
                      hybrid_fsdp_group=mesh[("dp_outer", "dp_shard")]._flatten("hsdp").get_group(),
                      hybrid_fsdp_expt_group=expt[("dp_outer", "dp_shard")]._flatten("hsdp_expt").get_group())
    ep_mesh: DeviceMesh = expt["ep"]
    return kwargs, ep_mesh.get_group(), ep_mesh.get_local_rank()


CASES = [dict(zero_dp_strategy=3), dict(zero_dp_strategy=1, average_in_collective=True),
         dict(zero_dp_strategy=3, outer_dp_sharding_strategy=0, hsdp=True),
         dict(zero_dp_strategy=3, outer_dp_sharding_strategy=1, hsdp=True, average_in_collective=True)]


@pytest.mark.matrix(mesh=matrix.param("case", lambda c: axes.mesh(2, outer=2) if c.get("hsdp") else axes.mesh(4)),
                    zero=axes.item("case", "zero_dp_strategy", axes.zero),
                    outer=matrix.param("case", lambda c: axes.outer(c.get("outer_dp_sharding_strategy"))))
@pytest.mark.parametrize("case", CASES, ids=["zero3", "zero1-avg", "hsdp", "hfsdp-avg"])
def test_moe_with_expert_parallelism_matches_one_process(case: dict, dist_env: Any) -> None:
    case = dict(case)
    kwargs, ep_group, ep_rank = _ep_meshes(case.pop("hsdp", False), dist_env.device.type)
    reference, local = _models(ep_group, ep_rank)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.2, momentum=0.9)
    model, opt = fully_shard(local, torch.optim.SGD(local.parameters(), lr=0.2, momentum=0.9),
                             fsdp_unit_modules=[MoEBlock], **kwargs, **case)
    units = {u.name: u for u in model._fsdp_engine.units}
    assert sorted(units) == ["<root>", "blocks.0", "blocks.0[experts]", "blocks.1", "blocks.1[experts]"]
    same_ep_rank = [r for r in range(dist_env.world_size) if r % EP == dist_env.rank % EP]
    expected = [dist_env.rank] if case.get("outer_dp_sharding_strategy") == 0 else same_ep_rank
    assert sorted(dist.get_process_group_ranks(units["blocks.0[experts]"].ctx.group)) == expected
    ref_params = dict(reference.named_parameters())
    for step in range(3):
        x, y = (t.to(dist_env.device) for t in _batch(step, dist_env.rank))
        nn.functional.mse_loss(model(x), y).backward()
        if step == 0:  # the first synced grads, before any update
            grads = {n: p.grad.full_tensor().cpu() for n, p in model.module.named_parameters()}
            ref_grads = _reference_grads_moe(reference, dist_env.world_size)
            assert_close(grads, {n: ref_grads[_reference_name(n, ep_rank)] for n in grads}, "grads")
            ref_opt.step()
            ref_opt.zero_grad()
        else:
            _reference_step(reference, ref_opt, step, dist_env.world_size)
        opt.step()
        opt.zero_grad()
    params = {n: p.full_tensor().cpu() for n, p in model.module.named_parameters()}
    assert_close(params, {n: ref_params[_reference_name(n, ep_rank)].detach() for n in params}, "params")


def _reference_grads_moe(reference: TinyMoE, world: int) -> dict[str, torch.Tensor]:
    losses = [nn.functional.mse_loss(reference(x), y) for x, y in (_batch(0, r) for r in range(world))]
    (torch.stack(losses).sum() / world).backward()
    return {n: p.grad.detach().clone() for n, p in reference.named_parameters()}


def test_expert_dist_index_and_errors(dist_env: Any, shared_tmp_path: Path) -> None:
    kwargs, ep_group, ep_rank = _ep_meshes(False, dist_env.device.type)
    expt = kwargs["expt_device_mesh"]
    model = fully_shard_model(_models(ep_group, ep_rank)[1], fsdp_unit_modules=[MoEBlock], **kwargs)
    idx = model.dist_index
    assert idx.get_fsdp_group(is_expert_parallel=True) is expt["dp_shard"].get_group()
    assert idx.get_dp_group(is_expert_parallel=True).size() == 2 and idx.get_dp_group().size() == 4
    assert idx.get_root_mesh(is_expert_parallel=True) is expt
    bad = init_device_mesh(dist_env.device.type, (2, EP), mesh_dim_names=("edp", "ep"))
    with pytest.raises(ValueError, match=r"expt_device_mesh has no dim dp_shard_dim='dp_shard' .* its dims: "
                                         r"\['edp', 'ep'\]"):
        fully_shard_model(_models(ep_group, ep_rank)[1], **dict(kwargs, expt_device_mesh=bad))
    with pytest.raises(ValueError, match=r"hybrid_fsdp_expt_group was given without expt_device_mesh"):
        fully_shard_model(TinyMoE(), hybrid_fsdp_expt_group=ep_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(NotImplementedError, match=r"does not support expert-parallel models yet"):
        checkpoint.save(shared_tmp_path / "ck", model, opt)
    with pytest.raises(NotImplementedError, match=r"does not support expert-parallel models yet"):
        checkpoint.load(shared_tmp_path / "ck", model, opt)
    assert not (shared_tmp_path / "ck").exists()


def test_allreduce_false_params_need_an_expert_mesh(dist_env: Any) -> None:
    """Megatron-Core marks expert params ``allreduce=False``; without an expert mesh they would
    be averaged over the wrong group, so (as in Megatron-FSDP) this is an error."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].weight.allreduce = False
    with pytest.raises(ValueError, match=r"parameter '1.weight' is an expert-parallel param \(allreduce=False\) "
                                         r"but no expt_device_mesh was given"):
        fully_shard_model(model)
    plain = TinyMoE()  # ".experts." params without an expert mesh: replicated experts, ordinary params
    wrapped = fully_shard_model(plain, fsdp_unit_modules=[MoEBlock])
    assert not any(u.name.endswith("[experts]") for u in wrapped._fsdp_engine.units)


@pytest.mark.matrix(mesh=axes.mesh(2, outer=2), outer=matrix.param("outer", axes.outer), model="cnn")
@pytest.mark.parametrize("outer", [0, 1])
@pytest.mark.parametrize("mode", ["default", "average_in_collective", "calculate_per_token_loss"])
def test_grad_reduction_modes_under_hsdp(mode: str, outer: int, dist_env: Any) -> None:
    """HSDP's dp_outer all-reduce and HFSDP's two-level reduce-scatter use the same op."""
    mesh = init_device_mesh(dist_env.device.type, (2, 2), mesh_dim_names=("dp_outer", "dp_shard"))
    hybrid = mesh[("dp_outer", "dp_shard")]._flatten("hsdp").get_group()
    kwargs = {} if mode == "default" else {mode: True}
    grads = fsdp_grads(dist_env, device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                        hybrid_fsdp_group=hybrid, outer_dp_sharding_strategy=outer, **kwargs)
    reduction = "sum" if mode == "calculate_per_token_loss" else "mean"
    assert_close(grads, reference_grads(dist_env.world_size, reduction), f"{mode}, outer {outer}")
