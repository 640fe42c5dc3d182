"""Installed grads across ``zero_grad(set_to_none=True)``: the user sees None, the buffer memory
is released, and the next backward re-installs the same DTensor objects (made once: creating
DTensors is slow) holding this step's grads, equal to an unwrapped model's."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_impl
from fsdp_impl.decoupled import local_tensor, read_grad

pytestmark = pytest.mark.distributed(world_size=1, timeout=120)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_grads_reinstalled_after_set_to_none(strategy: str, decoupled: bool) -> None:
    torch.manual_seed(0)
    module = nn.Sequential(Block(), Block())
    ref = copy.deepcopy(module)
    model = fsdp_impl.fully_shard_model(module, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                        use_decoupled_grad=decoupled)
    params = list(model.parameters())
    first: list[torch.Tensor | None] = []
    for step in range(3):
        x, y = _batch(step)
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
