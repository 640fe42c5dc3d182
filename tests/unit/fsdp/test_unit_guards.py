"""The guards that turn torch's ``mixed torch.Tensor and DTensor`` into our error when a module
holding a unit's params is called outside that unit's forward (``hooks._ShardedGuard``): a guard
is a forward pre-hook present exactly while its unit's sharded DTensor params are registered, so
inside the forward (and a recompute) the modules run with no hook at all: the engine's hot path
pays a few dict operations per unit swap, not a hook call per submodule call."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fsdp_impl

pytestmark = pytest.mark.distributed(world_size=1, timeout=120)


class Block(nn.Module):
    def __init__(self, seen: list[tuple[int, int]], recompute: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.seen = seen
        self.recompute = recompute

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((len(self.lin._forward_pre_hooks), len(self.norm._forward_pre_hooks)))
        return self.norm(torch.tanh(self.lin(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return x + checkpoint(self._inner, x, use_reentrant=False)
        return x + self._inner(x)


class Net(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.seen: list[tuple[int, int]] = []
        self.blocks = nn.Sequential(Block(self.seen, recompute), Block(self.seen, recompute))
        self.out = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_guards_are_in_place_outside_the_forward_only(zero: int, recompute: bool, dist_env) -> None:
    torch.manual_seed(0)
    net = Net(recompute)
    reference = Net(recompute)
    reference.load_state_dict(net.state_dict())
    model = fsdp_impl.fully_shard_model(net, fsdp_unit_modules=[Block], zero_dp_strategy=zero)
    subs = [net.blocks[0].lin, net.blocks[0].norm, net.blocks[1].lin, net.blocks[1].norm, net.out]
    assert [len(m._forward_pre_hooks) for m in subs] == [1] * 5, "after the wrap every guard is in place"
    x = torch.randn(3, 4)
    out = model(x)
    out.sum().backward()
    expected = reference(x)
    expected.sum().backward()
    assert torch.equal(out, expected)
    grads = {n: p.grad.full_tensor() for n, p in model.module.named_parameters()}
    for name, p in reference.named_parameters():
        assert torch.equal(grads[name], p.grad), f"{name}: grad differs from the unwrapped model"
    # forward: 2 blocks, + 2 recomputes in the backward
    assert net.seen == [(0, 0)] * (4 if recompute else 2), "inside a unit's forward its modules run hook-free"
    assert [len(m._forward_pre_hooks) for m in subs] == [1] * 5, "after the step every guard is back"
    with pytest.raises(RuntimeError, match=r"LayerNorm holds params of FSDP unit 'blocks\.0' .* 'blocks\.0\.norm'"):
        net.blocks[0].norm(x)


def test_fine_grained_submodules_keep_their_own_hook_and_no_guard(dist_env) -> None:
    """With enable_fine_grained_param_gather each param module already has the engine's own
    pre-forward hook (it gathers, and refuses a call outside the unit's forward): no guard too."""
    model = fsdp_impl.fully_shard_model(Net(False), fsdp_unit_modules=[Block], zero_dp_strategy=3,
                                        enable_fine_grained_param_gather=True)
    block = model.module.blocks[0]
    assert len(block.lin._forward_pre_hooks) == 1 and len(block.norm._forward_pre_hooks) == 1
    assert all(not u.guards for u in model._fsdp_engine.units[:-1])
    assert len(model._fsdp_engine.root.guards) == 1  # the root's own Linear
