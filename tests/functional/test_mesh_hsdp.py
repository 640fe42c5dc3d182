"""HSDP (outer no_shard) and HFSDP (outer optim) on a (dp_outer=2, dp_shard=2) mesh (issue 4).

Numbers: every case trains 3 steps of 2 accumulation microbatches (no sync, then sync) with SGD
(momentum; scale-sensitive, so a wrong average across dp_outer shows) and compares per-step losses,
synced grads and final params with a single-process reference on the union of all ranks' data.
Tolerance 1e-5 relative (fp32; measured <= 1e-6: only the order of sums differs).

Traffic: a ``CollectiveCounter`` checks each collective's group: HSDP all-reduces across dp_outer
only on the sync microbatch (once per unit with grads per cycle), reduce-scatters/all-gathers
stay inside dp_shard; HFSDP gathers and reduce-scatters over the hybrid group and never issues a
separate outer reduction.

``check_hsdp``/``check_hfsdp`` take the mesh shape and the device, so ``test_mesh_world2.py`` runs
the same checks on (dp_outer=2, dp_shard=1) with 2 ranks (2 GPUs under NCCL).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from fsdp_impl import fully_shard
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.collective_counter import CollectiveCounter, group_ranks
from tests.functional.common.models import build_model, loss_fn, unit_classes
from tests.functional.common.reference import global_batch, make_optimizer, train_reference
from tests.functional.common.training import Microbatch, train_accumulating
from tests.functional.test_mesh_support import data_position, full_params, relative_errors, seed_kwargs, seed_mesh

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=600),
    pytest.mark.matrix(mesh=axes.mesh(2, outer=2), dtype="fp32"),
]

RTOL = 1e-5
STEPS, MICRO, LOCAL = 3, 2, 4
HSDP_4 = (2, 2, 1, 1)  # (dp_outer, dp_shard, cp, tp) of the 4-rank cases


def _wrap(name: str, strategy: object, outer: str, device: torch.device, opt_kind: str = "sgd",
          shape: tuple[int, int, int, int] = HSDP_4):
    mesh = seed_mesh(shape, device.type)
    model = build_model(name, seed=0)
    opt = make_optimizer(opt_kind, model.named_parameters())
    fsdp_model, opt = fully_shard(model, opt, fsdp_unit_modules=list(unit_classes(name)),
                                  zero_dp_strategy=strategy, **seed_kwargs(mesh, outer))
    return mesh, fsdp_model, opt


def _train(name: str, fsdp_model, opt, mesh, device: torch.device,
           counters: list[CollectiveCounter] | None = None) -> list[float]:
    """3 steps x 2 microbatches on this rank's slice; with ``counters``, microbatch m's
    collectives are recorded in ``counters[m]`` (first step only)."""
    pos, n = data_position(mesh["hsdp"].get_group())
    per = LOCAL // MICRO

    def microbatches(step: int) -> list[Microbatch]:
        inputs, target = global_batch(name, step, n * LOCAL, torch.float32)
        spans = [slice(pos * LOCAL + m * per, pos * LOCAL + (m + 1) * per) for m in range(MICRO)]
        return [([x[s].to(device) for x in inputs], target[s].to(device)) for s in spans]

    def record(step: int, m: int) -> CollectiveCounter | None:
        return counters[m] if counters is not None and step == 0 else None

    return train_accumulating(fsdp_model, opt, STEPS, microbatches, loss_fn(name), device, record)


def _reference(name: str, opt_kind: str, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference on the test's device (like kernels with like), on all ranks' samples."""
    return train_reference(build_model(name, seed=0).to(device), name, opt_kind, STEPS,
                           dist.get_world_size() * LOCAL)


def _check_parity(name: str, losses: list[float], final: dict[str, torch.Tensor],
                  device: torch.device) -> None:
    ref_losses, ref_params = _reference(name, "sgd", device)
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), f"losses {losses} vs reference {ref_losses}"
    err, where = relative_errors(final, ref_params)
    assert err <= RTOL, f"param {where}: relative error {err:.3g}"


def check_hsdp(name: str, strategy: str, device: torch.device, shape: tuple[int, int, int, int]) -> None:
    """HSDP (outer no_shard) on ``shape``: parity, and outer traffic only on the sync microbatch."""
    mesh, model, opt = _wrap(name, strategy, "no_shard", device, shape=shape)
    counters = [CollectiveCounter(), CollectiveCounter()]
    losses = _train(name, model, opt, mesh, device, counters)
    _check_parity(name, losses, full_params(model), device)

    outer, inner = mesh["dp_outer"].get_group(), mesh["dp_shard"].get_group()
    units = [u for u in model._fsdp_engine.units if u.grad is not None]
    no_sync, sync = counters
    assert no_sync.count("all_reduce", outer) == 0, f"outer traffic before the sync microbatch: {no_sync.summary()}"
    assert sync.count("all_reduce", outer) == len(units), f"want one outer all-reduce per unit: {sync.summary()}"
    for c in counters:  # everything else stays inside dp_shard
        bad = [k for k in c.calls if k[1] not in (group_ranks(inner), group_ranks(outer))]
        assert not bad, f"collectives on unexpected groups: {bad}"
        assert c.count("all_reduce", outer) == c.count(ranks=group_ranks(outer)), c.summary()
    if strategy in ("optim_grads", "optim_grads_params"):
        assert no_sync.count("reduce_scatter_tensor", inner) == len(units)
    if strategy == "optim_grads_params":
        assert no_sync.count("all_gather_into_tensor", inner) >= len(model._fsdp_engine.units)
    idx = model.dist_index
    assert group_ranks(idx.get_fsdp_group()) == group_ranks(inner)
    assert group_ranks(idx.get_outer_fsdp_group()) == group_ranks(outer)
    assert idx.get_hybrid_fsdp_group() is mesh["hsdp"].get_group() and idx.get_tp_group() is None


def check_hfsdp(name: str, device: torch.device, shape: tuple[int, int, int, int]) -> None:
    """HFSDP (outer optim, inner 3) on ``shape``: parity; params gathered over the hybrid group,
    grads reduced in two levels (dp_outer only on the sync microbatch); main params and
    optimizer state sharded over all of it."""
    mesh, model, opt = _wrap(name, "optim_grads_params", "optim", device, shape=shape)
    counters = [CollectiveCounter(), CollectiveCounter()]
    losses = _train(name, model, opt, mesh, device, counters)
    _check_parity(name, losses, full_params(model), device)

    hybrid = group_ranks(mesh["hsdp"].get_group())
    ways = len(hybrid)
    inner = group_ranks(model.dist_index.get_fsdp_group())
    outer = group_ranks(mesh["dp_outer"].get_group())
    rs = "reduce_scatter_tensor"
    for c in counters:  # params: gathered over the whole hybrid group on every microbatch
        assert c.count("all_gather_into_tensor") == c.count("all_gather_into_tensor", ranks=hybrid) > 0
        assert c.count("all_reduce", mesh["dp_outer"].get_group()) == 0, c.summary()
    # grads: reduce-scattered inside dp_shard every microbatch (no collective for a 1-rank
    # dp_shard), across dp_outer once per unit on the sync microbatch only
    no_sync, sync = counters
    assert no_sync.count(rs, ranks=outer) == 0, no_sync.summary()
    assert sync.count(rs, ranks=outer) > 0, sync.summary()
    per_unit = sync.count(rs, ranks=outer)
    inner_calls = per_unit if len(inner) > 1 else 0
    assert no_sync.count(rs) == no_sync.count(rs, ranks=inner) == inner_calls, no_sync.summary()
    assert sync.count(rs) == inner_calls + per_unit and sync.count(rs, ranks=inner) == inner_calls, sync.summary()
    # main params (hence optimizer state) are sharded over dp_outer x dp_shard
    for n, p in model.module.named_parameters():
        rows = p.shape[0]
        assert p.to_local().shape[0] <= -(-rows // ways), f"{n}: local rows {p.to_local().shape[0]} of {rows}"
        assert p.device_mesh.size() == ways
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                row_numel = math.prod(v.shape[1:])
                assert local.numel() <= -(-v.shape[0] // ways) * row_numel, f"optimizer state not sharded {ways} ways"
    assert group_ranks(model.dist_index.get_fsdp_group()) == group_ranks(mesh["dp_shard"].get_group())


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), outer="no_shard", model=matrix.param("name"))
def test_hsdp_parity_and_traffic(name: str, strategy: str, dist_env) -> None:
    check_hsdp(name, strategy, dist_env.device, HSDP_4)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.matrix(zero="optim_grads_params", outer="optim", model=matrix.param("name"))
def test_hfsdp_parity_and_traffic(name: str, dist_env) -> None:
    check_hfsdp(name, dist_env.device, HSDP_4)


@pytest.mark.matrix(zero="optim_grads_params", outer="no_shard", model="cnn")
def test_hsdp_adam_accumulation_matches_reference(dist_env) -> None:
    """Adam as the seed uses it (outer no_shard, inner ZeRO-3): losses and params."""
    mesh, model, opt = _wrap("cnn", 3, "no_shard", dist_env.device, opt_kind="adam")
    losses = _train("cnn", model, opt, mesh, dist_env.device)
    ref_losses, ref_params = _reference("cnn", "adam", dist_env.device)
    err, where = relative_errors(full_params(model), ref_params)
    assert err <= 1e-4 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, ref_losses, strict=True)), \
        f"{where}: {err:.3g}; losses {losses} vs {ref_losses}"
