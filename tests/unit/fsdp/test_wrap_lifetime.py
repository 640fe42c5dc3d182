"""What a wrapped model keeps alive: not the user's original (unsharded) params once the wrap
returns, and nothing at all once the wrapper and the optimizer are deleted (no reference cycle
through the hooks, so plain reference counting frees the engine and its buffers). And what it
keeps across ``zero_grad(set_to_none=True)``: the user sees None and the grad memory is
released, but the next backward re-installs the same grad DTensor objects (made once: creating
DTensors is slow) holding that step's grads, equal to an unwrapped model's."""
from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

import fsdp_impl
from fsdp_impl.decoupled import read_grad
from fsdp_impl.placement import local_tensor

pytestmark = pytest.mark.distributed(world_size=1, timeout=120)

STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Only reference counting may free objects inside the test (a cycle would survive)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _wrap(strategy: str) -> tuple[nn.Module, torch.optim.Optimizer, list[StorageWeakRef]]:
    torch.manual_seed(0)
    module = Net()
    originals = [StorageWeakRef(p.untyped_storage()) for p in module.parameters()]
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    model, opt = fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy)
    return model, opt, originals


def _train(model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, steps: int = 2) -> None:
    """Batches on ``device``: the engine computes on CUDA wherever the ranks run NCCL."""
    for step in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step)).to(device)
        F.mse_loss(model(x), torch.zeros(4, 2, device=device)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_original_params_released_by_wrap(strategy: str, no_gc: None, dist_env) -> None:
    model, opt, originals = _wrap(strategy)
    alive = [i for i, ref in enumerate(originals) if not ref.expired()]
    assert not alive, f"original param storages {alive} survive fully_shard"
    shards = {id(p) for p in model.parameters()}
    assert all(id(p) in shards for g in opt.param_groups for p in g["params"])  # the optimizer was remapped
    engine = model._fsdp_engine
    p = engine.units[0].params[0]
    assert p.orig_id not in shards
    with pytest.raises(RuntimeError, match="original .* param was released"):
        _ = p.orig
    _train(model, opt, dist_env.device)  # still trains


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_engine_and_buffers_freed_on_del(strategy: str, no_gc: None, dist_env) -> None:
    model, opt, _ = _wrap(strategy)
    _train(model, opt, dist_env.device)
    opt.zero_grad(set_to_none=False)  # keep the grad buffers allocated, so their storage is tracked
    engine = model._fsdp_engine
    ref = weakref.ref(engine)
    storages = [StorageWeakRef(u.weight.data.untyped_storage()) for u in engine.units]
    storages += [StorageWeakRef(u.grad.data.untyped_storage()) for u in engine.units if u.grad is not None]
    storages += [StorageWeakRef(local_tensor(p.unsharded).untyped_storage())
                 for u in engine.units for p in u.params]
    del engine, model, opt
    assert ref() is None, f"the engine survives del model/optimizer: held by {gc.get_referrers(ref())}"
    alive = [i for i, s in enumerate(storages) if not s.expired()]
    assert not alive, f"engine buffer storages {alive} survive del model/optimizer"


def test_inner_module_without_wrapper_raises(no_gc: None, dist_env) -> None:
    model, opt, _ = _wrap("optim_grads_params")
    inner = model.module
    del model, opt
    with pytest.raises(RuntimeError, match="fully_shard wrapper was garbage collected"):
        inner(torch.zeros(1, 8, device=dist_env.device))


def _batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=gen).to(device), torch.randn(4, 8, generator=gen).to(device)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_grads_reinstalled_after_set_to_none(strategy: str, decoupled: bool, dist_env) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(module).to(dist_env.device)
    model = fsdp_impl.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                        use_decoupled_grad=decoupled)
    params = list(model.parameters())
    first: list[torch.Tensor | None] = []
    for step in range(3):
        x, y = _batch(step, dist_env.device)
        F.mse_loss(model(x), y).backward()
        ref.zero_grad(set_to_none=True)
        F.mse_loss(ref(x), y).backward()
        grads = [read_grad(p, decoupled) for p in params]
        if step == 0:
            first = grads
        else:
            assert all(g is f for g, f in zip(grads, first, strict=True)), "grad DTensors were re-created"
        for g, r in zip(grads, ref.parameters(), strict=True):
            assert g is not None
            torch.testing.assert_close(local_tensor(g), r.grad, rtol=0, atol=0)
        model.zero_grad(set_to_none=True)
        assert all(read_grad(p, decoupled) is None for p in params)
        units = model._fsdp_engine.units
        assert all(u.grad.data.untyped_storage().size() == 0 for u in units if u.grad is not None)
