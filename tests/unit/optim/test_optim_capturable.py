"""fsdp_impl.optim.Adam/AdamW(capturable=True) on CPU: what makes the step graph-safe (no value
ever read back to the host; the step counter is a tensor on the param's device) and that it
trains like capturable=False.

capturable=True cannot match capturable=False bit for bit: the non-capturable step computes the
bias corrections in float64 on the host and passes the step size as a scalar, the capturable one
computes them as fp32 tensors on the device (torch's capturable formula, whose divisions are also
reordered). Both are fp32-rounding-close, so 1e-6 relative over the run; the GPU suite compares
capturable eager against capturable replay bit for bit.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp_impl.optim import Adam, AdamW

STEPS = 12
CONFIGS: list[dict[str, Any]] = [
    {},
    {"weight_decay": 0.1, "amsgrad": True},
    {"maximize": True, "betas": (0.8, 0.99), "eps": 1e-6},
    {"exp_avg_dtype": torch.bfloat16, "exp_avg_sq_dtype": torch.bfloat16},
    {"use_decoupled_grad": True, "lr": torch.tensor(3e-3)},
]


def _ids(config: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "default"


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(6, 3), (5,), (0,)]]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], attr: str, steps: int = STEPS) -> None:
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            setattr(p, attr, torch.randn(p.shape, generator=gen))
        opt.step()


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Every way of reading a tensor value back to Python raises (each is a device sync on CUDA)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a tensor value was read back to the host")

    with pytest.MonkeyPatch.context() as patch:
        for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
            patch.setattr(torch.Tensor, name, refuse)
        yield


@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_capturable_trains_like_non_capturable(cls: type, config: dict[str, Any]) -> None:
    attr = "decoupled_grad" if config.get("use_decoupled_grad") else "grad"
    eager_p, capt_p = _params(), _params()
    eager = cls(eager_p, **{"lr": 1e-2, **config})
    capt = cls(capt_p, capturable=True, **{"lr": 1e-2, **config})
    _train(eager, eager_p, attr)
    _train(capt, capt_p, attr)
    moved = 0.0
    for a, b, start in zip(capt_p, eager_p, _params(), strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-6, atol=1e-6)
        if a.numel():
            moved = max(moved, (a - start).abs().max().item())
    assert moved > 1e-3, "the optimizer did not move the parameters"
    step = capt.state[capt_p[0]]["step"]
    assert isinstance(step, torch.Tensor) and step.device == capt_p[0].device and step.item() == STEPS


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("config", CONFIGS, ids=_ids)
def test_capturable_step_reads_nothing_back(config: dict[str, Any], foreach: bool) -> None:
    """The whole capturable step (state creation included) works without a host read, on the
    per-parameter and the multi-tensor path; the same guard catches the non-capturable step, so
    the guard itself works."""
    attr = "decoupled_grad" if config.get("use_decoupled_grad") else "grad"
    params, other_params = _params(), _params()
    opt = AdamW(params, capturable=True, foreach=foreach, **{"lr": 1e-2, **config})
    other = AdamW(other_params, **{"lr": 1e-2, **config})
    with no_host_reads():
        _train(opt, params, attr, steps=3)
        with pytest.raises(AssertionError, match="read back to the host"):
            _train(other, other_params, attr, steps=1)


def test_capturable_dtensor_params(one_rank_mesh: Any) -> None:
    """Sharded (DTensor) params step through their local shards, counter on the shard's device."""
    full = _params()
    plain = AdamW(full, capturable=True, lr=1e-2, weight_decay=0.1)
    sharded_p = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), one_rank_mesh, [Shard(0)]))
                 for p in _params()]
    sharded = AdamW(sharded_p, capturable=True, lr=1e-2, weight_decay=0.1)
    for step in range(4):
        gen = torch.Generator().manual_seed(7 + step)
        for p, q in zip(full, sharded_p, strict=True):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g
            q.grad = distribute_tensor(g, one_rank_mesh, [Shard(0)])
        plain.step()
        sharded.step()
    for p, q in zip(full, sharded_p, strict=True):
        assert torch.equal(p.detach(), q.full_tensor().detach())
    assert sharded.state[sharded_p[0]]["step"].item() == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch capturable foreach Adam)")
@pytest.mark.parametrize("cls,ref_cls", [(Adam, torch.optim.Adam), (AdamW, torch.optim.AdamW)], ids=["Adam", "AdamW"])
def test_capturable_foreach_equals_torch_on_cuda(cls: type, ref_cls: type) -> None:
    """On CUDA, capturable=True defaults to the multi-tensor path, which is torch's capturable
    foreach step op for op: bit-identical parameters."""
    params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    ref_params = [torch.nn.Parameter(p.detach().cuda()) for p in _params()]
    opt = cls(params, lr=1e-2, weight_decay=0.1, amsgrad=True, capturable=True)
    ref = ref_cls(ref_params, lr=1e-2, weight_decay=0.1, amsgrad=True, capturable=True, foreach=True)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 + step)
        for p, q in zip(params, ref_params, strict=True):
            g = torch.randn(p.shape, generator=gen).cuda()
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for i, (p, q) in enumerate(zip(params, ref_params, strict=True)):
        assert torch.equal(p.detach(), q.detach()), f"param {i} differs from torch's capturable foreach step"
