"""Decoupled gradients under HSDP (outer ``no_shard``) and HFSDP (outer ``optim``).

Extends ``test_decoupled_grad.py`` (1-D meshes only) to a (dp_outer=2, dp_shard=2, cp=1, tp=1)
mesh: inner strategies 1-3 with outer ``no_shard``, and inner 3 with outer ``optim``. The model,
data, reference trainer and loss detector are the shared ones (``common/decoupled.py``); only
the data split differs: the 4 ranks of the hybrid (dp_outer x dp_shard) group each take a different slice of the
global batch, by their position in that group (``data_position``), so the engine must average
over dp_shard *and* dp_outer to reproduce the single-process reference trained on the union.

Checks per case: buffer, optimizer and clipping flags agree; after the sync backward every
param has a DTensor ``decoupled_grad`` (non-zero wherever the local shard is non-empty) and no
``.grad``; ``fsdp_impl.clip_grad_norm`` gives the same norm on every rank and it equals
``torch.nn.utils.clip_grad_norm_`` on the reference; 5 AdamW steps (with clipping) follow the
reference's losses. Tolerances are the 1-D suite's: NORM_RTOL 1e-5, and LOSS_RTOL 1e-4
through ``loss_check_problem``.

Measured on CPU/gloo (fp32, torch 2.13, 2 loaded cores), worst over the four cases and 5 steps:
clipped norms within 1.2e-7 relative (the step-0 norm bit-identical to the reference), losses
within 1.4e-7 relative (HFSDP; 9.4e-8 under outer no_shard) -- three orders of magnitude inside
the tolerances. The sensitivity case (every rank trains on rank 0's slice, i.e. the dp_outer
replicas and dp_shard peers all fed the same data) is off by 4.4e-1 relative at its worst step.
The whole file (13 tests, one 4-rank bucket) ran in 20-30 s. The ``[measure]`` lines
printed by the tests show these numbers again with ``pytest -rA``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp_impl.clip_grad import clip_grad_norm
from fsdp_impl.decoupled import optimizer_reads_decoupled_grad
from fsdp_impl.placement import local_tensor
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common import decoupled
from tests.functional.common.mesh import data_group, data_position, seed_kwargs, seed_mesh
from tests.functional.common.numerics import max_loss_error

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=600),
    pytest.mark.matrix(mesh=axes.mesh(2, outer=2), model="decoupled_net", dtype="fp32"),
]

MESH_SHAPE = (2, 2, 1, 1)  # (dp_outer, dp_shard, cp, tp)
CASES = [
    pytest.param(1, "no_shard", id="optim-outer_no_shard"),
    pytest.param(2, "no_shard", id="optim_grads-outer_no_shard"),
    pytest.param(3, "no_shard", id="optim_grads_params-outer_no_shard"),
    pytest.param(3, "optim", id="optim_grads_params-outer_optim"),
]


@dataclass(frozen=True)
class _DataSlot:
    """The three ``dist_env`` fields the imported data helpers read, with ``rank`` replaced by
    this rank's position in the data-parallel group: the helpers slice the global batch by
    ``rank``, which on a 1-D mesh is the position, but not under HSDP in general."""

    rank: int
    world_size: int
    device: torch.device


def _hybrid_setup(env: Any, strategy: int, outer: str) -> tuple[torch.nn.Module, Any, torch.nn.Module, _DataSlot]:
    """(wrapped model, optimizer, reference copy, this rank's data slot) on the 2x2 mesh."""
    mesh = seed_mesh(MESH_SHAPE, env.device.type)
    pos, size = data_position(data_group(mesh, outer))
    assert size == env.world_size, "test setup: all 4 ranks must see different data"
    model, optimizer, ref = decoupled.wrap(env, strategy, **seed_kwargs(mesh, outer))
    return model, optimizer, ref, _DataSlot(pos, size, env.device)


def _grad_shard_ranks(mesh: Any, outer: str) -> list[int]:
    """The ranks a param's DTensor (and so its decoupled grad) spans: (dp_outer, dp_shard) under
    outer ``no_shard`` (placements [Replicate(), Shard(0)]), the hybrid group under outer
    ``optim`` (sharded over all of it)."""
    names = "hsdp" if outer == "optim" else ("dp_outer", "dp_shard")
    return sorted(mesh[names].mesh.flatten().tolist())


def _expected_dp_placements(outer: str, strategy: int) -> tuple:
    inner = Replicate() if strategy == 0 else Shard(0)
    return (inner,) if outer == "optim" else (Replicate(), inner)


def _same_on_all_ranks(value: float, device: torch.device) -> list[float]:
    """Every rank's ``value`` (an all-gather on ``device``: NCCL needs CUDA tensors), to check
    that ranks agree exactly."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    return [g.item() for g in gathered]


@pytest.mark.parametrize("strategy,outer", CASES)
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), outer=matrix.param("outer", axes.outer))
class TestDecoupledGradOuter:
    def test_flags_agree_and_grads_after_sync(self, dist_env: Any, strategy: int, outer: str) -> None:
        model, optimizer, _, slot = _hybrid_setup(dist_env, strategy, outer)
        assert model.param_and_grad_buffer.use_decoupled_grad is True
        assert optimizer_reads_decoupled_grad(optimizer) is True
        shard_ranks = _grad_shard_ranks(seed_mesh(MESH_SHAPE, dist_env.device.type), outer)
        x, y = decoupled.local_batch(0, slot)
        F.mse_loss(model(x), y).backward()
        owned = 0
        for name, p in model.named_parameters():
            assert p.grad is None, f"{name}: .grad set although the buffer is decoupled"
            grad = getattr(p, "decoupled_grad", None)
            assert grad is not None, f"{name}: decoupled_grad is None after sync on rank {dist_env.rank}"
            assert isinstance(grad, DTensor), f"{name}: decoupled_grad is {type(grad).__name__}, not a DTensor"
            assert grad.placements == p.placements and grad.device_mesh == p.device_mesh, name
            assert sorted(grad.device_mesh.mesh.flatten().tolist()) == shard_ranks, \
                f"{name}: grad mesh {grad.device_mesh}"
            assert tuple(grad.placements) == _expected_dp_placements(outer, strategy), f"{name}: {grad.placements}"
            local = local_tensor(grad)
            assert local.shape == local_tensor(p).shape, name
            if local.numel():
                owned += 1
                assert local.count_nonzero().item() > 0, f"{name}: all-zero decoupled grad on rank {dist_env.rank}"
        assert owned > 0 or dist_env.rank > 0  # rank 0 always owns the first shard of everything
        # Clipping follows the switch: reading .grad finds nothing.
        from_model = clip_grad_norm(model, 1e9).item()
        assert from_model > 0
        assert from_model == clip_grad_norm(model.parameters(), 1e9, use_decoupled_grad=True).item()
        assert clip_grad_norm(model.parameters(), 1e9).item() == 0.0

    def test_clip_norm_matches_reference(self, dist_env: Any, strategy: int, outer: str) -> None:
        model, _, ref, slot = _hybrid_setup(dist_env, strategy, outer)
        x, y = decoupled.local_batch(0, slot)
        F.mse_loss(model(x), y).backward()
        gx, gy = decoupled.global_batch(0, slot.world_size, dist_env.device)
        F.mse_loss(ref(gx), gy).backward()
        norm = clip_grad_norm(model, decoupled.MAX_NORM).item()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), decoupled.MAX_NORM).item()
        assert ref_norm > decoupled.MAX_NORM, "test setup: the reference must actually clip"
        norms = _same_on_all_ranks(norm, dist_env.device)
        assert all(n == norm for n in norms), f"ranks disagree on the norm: {norms}"
        print(f"[measure] {strategy}/{outer} norm rel err {max_loss_error([norm], [ref_norm]):.3e}")
        assert norm == pytest.approx(ref_norm, rel=decoupled.NORM_RTOL)
        for (name, p), r in zip(model.named_parameters(), ref.parameters(), strict=True):
            full = p.decoupled_grad.full_tensor()
            torch.testing.assert_close(full, r.grad, rtol=decoupled.NORM_RTOL, atol=1e-7, msg=f"clipped grad of {name}")

    def test_losses_match_reference(self, dist_env: Any, strategy: int, outer: str) -> None:
        model, optimizer, ref, slot = _hybrid_setup(dist_env, strategy, outer)
        trace = decoupled.train_clipped(model, optimizer, slot)
        ref_trace = decoupled.train_clipped_reference(ref, slot)
        for got, want in ((trace.norms, ref_trace.norms), (trace.losses, ref_trace.losses)):
            print(f"[measure] {strategy}/{outer} max rel err {max_loss_error(got, want):.3e}")
        assert trace.norms == pytest.approx(ref_trace.norms, rel=decoupled.NORM_RTOL), "clipped norms per step"
        for step, norm in enumerate(trace.norms):
            norms = _same_on_all_ranks(norm, dist_env.device)
            assert all(n == norm for n in norms), f"step {step}: ranks disagree on the norm: {norms}"
        problem = decoupled.loss_check_problem(trace.losses, ref_trace.losses)
        assert problem is None, problem


def test_wrong_data_split_is_detected(dist_env: Any) -> None:
    """The loss check is sensitive to the split: if every rank trains on rank 0's slice (as when
    dp_outer replicas are wrongly fed the same data), the run leaves the reference's tolerance."""
    model, optimizer, ref, slot = _hybrid_setup(dist_env, 3, "no_shard")
    wrong = _DataSlot(0, slot.world_size, slot.device)
    trace = decoupled.train_clipped(model, optimizer, wrong)
    ref_trace = decoupled.train_clipped_reference(ref, slot)
    print(f"[measure] wrong split max rel err {max_loss_error(trace.losses, ref_trace.losses):.3e}")
    assert trace.norms[0] != pytest.approx(ref_trace.norms[0], rel=decoupled.NORM_RTOL), "norm blind to the split"
    problem = decoupled.loss_check_problem(trace.losses, ref_trace.losses)
    assert problem is not None, f"the detector missed a wrong data split: losses {trace.losses}"
    assert "differs from the reference" in problem or "did not decrease" in problem
