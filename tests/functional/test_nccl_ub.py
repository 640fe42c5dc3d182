"""NCCL user buffers (``nccl_ub=True``, ``fsdp_impl/nccl_ub.py``): the bookkeeping on gloo with
the registrations recorded (``fsdp_impl._testing.NCCL_UB_RECORDED``), and on one GPU with NCCL.

Checked: the pool is registered exactly once, after the first sync backward, with every group the
model communicates on, in the same order on every rank (gathered and compared); training is
bit-identical to ``nccl_ub=False``; ``nccl_ub`` implies the 2-slot unshard pool for ZeRO-3
(Megatron-FSDP's ``fsdp_double_buffer``); the grad shards are never freed (``zero_grad()`` keeps
the registered memory); ranks that disagree on ``nccl_ub`` fail together at wrap time instead of
hanging in a registration only some of them make.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_impl
from fsdp_impl._testing import NCCL_UB_RECORDED
from fsdp_impl.unshard_storage import UnshardStorageKind
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.mesh import seed_kwargs, seed_mesh
from tests.functional.common.models import build_model, loss_fn, make_batch, unit_classes

pytestmark = pytest.mark.matrix(model="gpt", dtype="fp32", graph="eager")
STEPS = 3


def _train(model: Any, opt: torch.optim.Optimizer, env: Any) -> list[float]:
    losses = []
    for step in range(STEPS):
        inputs, target = make_batch("gpt", 2 * env.world_size, seed=100 + step)
        sl = slice(2 * env.rank, 2 * env.rank + 2)
        loss = loss_fn("gpt")(model(*(x[sl].to(env.device) for x in inputs)), target[sl].to(env.device))
        loss.backward()
        opt.step()
        opt.zero_grad()  # set_to_none=True: user buffers keep the grad shards
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


def _wrap(strategy: int, ub: bool, **kwargs: Any) -> tuple[Any, torch.optim.Optimizer]:
    module = build_model("gpt", seed=0)
    return fsdp_impl.fully_shard(module, torch.optim.Adam(module.parameters(), lr=1e-2),
                                 fsdp_unit_modules=list(unit_classes("gpt")), zero_dp_strategy=strategy,
                                 nccl_ub=ub, **kwargs)


def _check(strategy: int, env: Any, **kwargs: Any) -> list[tuple[int, ...]]:
    """Train with and without user buffers; return this rank's registration order."""
    want = _train(*_wrap(strategy, False, **kwargs), env)
    with NCCL_UB_RECORDED.on() as recorded:
        model, opt = _wrap(strategy, True, **kwargs)
        assert recorded == [], "registered before any step"
        grads = [u.grad.data for u in model._fsdp_engine.units if u.grad is not None]
        got = _train(model, opt, env)
        assert all(g.untyped_storage().size() > 0 for g in grads), "a registered grad shard was freed"
    assert got == want, f"losses with nccl_ub {got} != without {want}"
    assert len(recorded) == 1, f"registered {len(recorded)} times in {STEPS} steps (once expected)"
    if strategy == 3:
        kinds = {u.ctx.unshard.kind for u in model._fsdp_engine.units}
        assert kinds == {UnshardStorageKind.POOL}, f"nccl_ub should imply the unshard pool, got {kinds}"
    order = recorded[0]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, order)
    # Registration is collective per group: the i-th registration of a rank must be the i-th of
    # every other member of that group (the same group, at the same position).
    assert len({len(o) for o in everyone}) == 1, everyone
    for rank, sequence in enumerate(everyone):
        for i, group in enumerate(sequence):
            assert rank in group and all(everyone[m][i] == group for m in group), \
                f"registration {i}: rank {rank} registers {group}, its members {[everyone[m][i] for m in group]}"
    return order


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("strategy", [1, 2, 3])
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("strategy", axes.zero))
def test_nccl_ub_registers_once_in_order_and_trains_identically(strategy: int, dist_env: Any) -> None:
    order = _check(strategy, dist_env)
    assert order == [(0, 1)], order  # one group: the shard group


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.matrix(mesh=axes.mesh(2, outer=2), zero="optim_grads_params", outer=matrix.param("outer"))
def test_nccl_ub_hsdp_registers_every_group_in_one_order(outer: str, dist_env: Any) -> None:
    order = _check(3, dist_env, **seed_kwargs(seed_mesh((2, 2, 1, 1)), outer))
    assert len(order) == len(set(order)) >= 2, order  # the shard group and the replica/hybrid groups


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params")
def test_ranks_disagreeing_on_nccl_ub_fail_together_at_wrap(dist_env: Any) -> None:
    """A rank that registers while another does not would hang both; the wrap-time agreement
    turns that into the same error on every rank."""
    with NCCL_UB_RECORDED.on(), pytest.raises(ValueError, match=r"different arguments or models on different ranks"):
        _wrap(3, dist_env.rank == 0)


def _check_on_gpu(symmetric: bool, env: Any) -> None:
    """NCCL: the pool is registered (once per group) and training is bit-identical to unregistered
    buffers; ``disable_symmetric_registration`` picks the local registration."""
    from fsdp_impl.nccl_ub import allocator_unavailable
    if dist.get_backend() != "nccl":
        pytest.skip(f"needs the NCCL backend, one GPU per rank (this run uses {dist.get_backend()!r})")
    why = allocator_unavailable(dist.group.WORLD, env.device)
    if why is not None:  # the wrap refuses with this message (checked below); nothing to register
        with pytest.raises(RuntimeError, match=r"nccl_ub=True .* needs NCCL's memory allocator"):
            _wrap(3, True, disable_symmetric_registration=not symmetric)
        pytest.skip(f"NCCL's memory allocator is unavailable on this GPU: {why}")
    kwargs = dict(disable_symmetric_registration=not symmetric)
    want = _train(*_wrap(3, False, **kwargs), env)
    model, opt = _wrap(3, True, **kwargs)
    got = _train(model, opt, env)
    ub = model._fsdp_engine.ctx.user_buffers
    assert ub is not None and ub.registered and ub.registrations == len(ub.groups) == 1, vars(ub)
    assert got == want, f"losses with nccl_ub {got} != without {want}"


@pytest.mark.requires_cuda
@pytest.mark.distributed(world_size=1)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "local"])
@pytest.mark.matrix(mesh=axes.mesh(1), zero="optim_grads_params")
def test_nccl_ub_on_one_gpu(symmetric: bool, dist_env: Any) -> None:
    _check_on_gpu(symmetric, dist_env)


@pytest.mark.requires_cuda
@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "local"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params")
def test_nccl_ub_on_two_gpus(symmetric: bool, dist_env: Any) -> None:
    """The same on two GPUs: the registered all-gathers and reduce-scatters really move data."""
    _check_on_gpu(symmetric, dist_env)


class _FakePool:
    """A pool whose segments are given (``snapshot`` as torch's MemPool returns it)."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def snapshot(self) -> list[dict[str, int]]:
        return [{"address": 1000 - i, "total_size": n} for i, n in enumerate(reversed(self.sizes))]


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params")
def test_symmetric_registration_refuses_segments_that_differ_between_ranks(dist_env: Any) -> None:
    """Every rank raises the same clear error before any window registration (seen on 2 H200s:
    NCCL failed inside and the pool's destructor aborted the process); equal segments pass the
    check and reach the backend (gloo has no ``register_mem_pool``: the AttributeError shows it)."""
    from fsdp_impl.nccl_ub import UserBuffers

    def buffers(sizes: list[int], symmetric: bool = True) -> UserBuffers:
        ub = UserBuffers.__new__(UserBuffers)
        ub.groups, ub.device, ub.symmetric, ub.registrations = [dist.group.WORLD], dist_env.device, symmetric, 0
        ub.pool, ub._registered = _FakePool(sizes), False  # type: ignore[assignment]
        return ub

    odd = [2 << 20, (194 if dist_env.rank == 0 else 98) << 20]
    with pytest.raises(RuntimeError, match=r"rank 0 has \[2\.0, 194\.0\] MiB .* rank 1 has \[2\.0, 98\.0\] MiB .*"
                                           r"segment 1.*disable_symmetric_registration=True"):
        buffers(odd).register()
    with pytest.raises(AttributeError, match="register_mem_pool"):
        buffers([2 << 20, 4 << 20]).register()
    with pytest.raises(AttributeError, match="register_mem_pool"):  # local registration: not compared
        buffers(odd, symmetric=False).register()
