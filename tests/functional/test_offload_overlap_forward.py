"""``OffloadPolicy(overlap_step="forward")``: the host step overlaps the backward and runs on into the
next forward (``optimizer.step()`` returns at once; each unit's gather waits for its step), on gloo.

The host step is slowed (a sleep before each unit's kernel) so that it is still running when
``step()`` returns: every check then sees the state a fast host reaches only sometimes. The
reference is the same offloaded run with ``overlap_step=False`` (everything must be bit-identical:
losses, params, optimizer state), the lr halved after every ``step()`` as a scheduler would, so a
unit stepped with the new lr, a forward that did not wait for its unit, or state read before the
step finished shows as a difference of order lr.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_impl
from fsdp_impl.offload import optim as offload_optim
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.models import build_model, unit_classes
from tests.functional.common.offload import full_tensor, window

pytestmark = pytest.mark.matrix(model="gpt", dtype="fp32", mesh=axes.mesh(2))
OVERLAP_ATTR = "_fsdp_offload_overlap"
SLOW_S = 0.02  # per unit: longer than the rest of a tiny step, so step() returns with units pending


def _slow_host_step(monkeypatch: pytest.MonkeyPatch, fail_on: str | None = None) -> None:
    """Each overlapped unit step sleeps first (and, with ``fail_on``, that unit raises)."""
    real = offload_optim.host_step_units

    def slow(optimizer: Any, units: list, grad_of: Any, hyper: Any = None) -> None:
        time.sleep(SLOW_S)
        if fail_on is not None and any(u.name == fail_on for u in units):
            raise ValueError(f"host step of {fail_on} failed")
        real(optimizer, units, grad_of, hyper)

    monkeypatch.setattr(offload_optim, "host_step_units", slow)


def _wrap(device: torch.device, strategy: int, overlap: Any) -> tuple[Any, Any]:
    module = build_model("gpt", torch.float32, 0)
    opt = torch.optim.Adam(module.parameters(), lr=1e-2)
    policy = fsdp_impl.OffloadPolicy(step="cpu", pin_memory=device.type == "cuda", overlap_step=overlap)
    return fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=list(unit_classes("gpt")),
                                 zero_dp_strategy=strategy, offload_policy=policy)


def _batch(step: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, 13, (2, 6), generator=gen).to(device)  # SmallGPT: vocab 13, seq 6


def _loss(model: Any, step: int, device: torch.device) -> torch.Tensor:
    return model(_batch(step, device)).float().square().mean()


def _train(device: torch.device, strategy: int, overlap: Any, steps: int = 3) -> tuple[list[float], Any, Any, list]:
    """``steps`` steps, the lr halved right after each ``step()``; returns the losses, the model,
    the optimizer and, per step, whether units were still stepping when ``step()`` returned."""
    model, opt = _wrap(device, strategy, overlap)
    losses, pending = [], []
    for step in range(steps):
        loss = _loss(model, step, device)
        loss.backward()
        opt.step()
        overlap_ctl = opt.__dict__.get(OVERLAP_ATTR)
        pending.append(overlap_ctl is not None and overlap_ctl.stepping is not None)
        for group in opt.param_groups:  # a scheduler's step: must not reach the units still stepping
            group["lr"] *= 0.5
        opt.zero_grad()  # set_to_none: does not wait
        losses.append(loss.item())
    return losses, model, opt, pending


def _final(model: Any, opt: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    fsdp_impl.wait_for_step(opt)
    params = {n: full_tensor(p) for n, p in model.module.named_parameters()}
    state = {n: {k: full_tensor(v) if hasattr(v, "full_tensor") else v.clone() for k, v in opt.state[p].items()}
             for n, p in model.module.named_parameters()}
    return params, state


def _no_worker_left() -> None:
    alive = [t.name for t in threading.enumerate() if t.name == "fsdp-offload-step"]
    assert not alive, f"overlap worker threads outlived the step: {alive}"


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("strategy", [2, 3], ids=["zero2", "zero3"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), offload="cpu_overlap_forward")
def test_the_step_running_on_into_the_forward_equals_the_step_after_the_backward(
        strategy: int, dist_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit for bit with overlap_step=False (losses, params, optimizer state), though step()
    returned with units still stepping and the lr changed at once (ZeRO-3: each unit's gather
    waits for its own step; ZeRO-2: the forward waits for all); no thread left behind."""
    device = dist_env.device
    _slow_host_step(monkeypatch)
    with window(device):
        ref_losses, ref_model, ref_opt, _ = _train(device, strategy, False)
        losses, model, opt, pending = _train(device, strategy, "forward")
    assert all(pending), f"step() should return with units still stepping: {pending}"
    assert losses == ref_losses, (losses, ref_losses)
    (params, state), (ref_params, ref_state) = _final(model, opt), _final(ref_model, ref_opt)
    for name, value in ref_params.items():
        assert torch.equal(params[name], value), f"{name}: max abs {(params[name] - value).abs().max().item():.3e}"
    for name, entries in ref_state.items():
        for key, value in entries.items():
            assert torch.equal(state[name][key], value), f"state {key} of {name} differs"
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(zero="optim_grads_params", offload="cpu_overlap_forward")
def test_what_waits_for_a_step_running_on(dist_env, monkeypatch: pytest.MonkeyPatch) -> None:
    """zero_grad(set_to_none=True) does not wait; the optimizer's and the model's state_dict,
    zero_grad(set_to_none=False), clip_grad_norm and wait_for_step do; a failed host step is
    raised by the next forward, with no thread left; step='gpu' is refused for this mode."""
    device = dist_env.device
    _slow_host_step(monkeypatch)
    with window(device):
        model, opt = _wrap(device, 3, "forward")
    ctl = opt.__dict__[OVERLAP_ATTR]
    waits = {"optimizer.state_dict": lambda: opt.state_dict(), "model.state_dict": lambda: model.state_dict(),
             "zero_grad(set_to_none=False)": lambda: opt.zero_grad(set_to_none=False),
             "clip_grad_norm": lambda: fsdp_impl.clip_grad_norm(model, 1.0),
             "wait_for_step": lambda: fsdp_impl.wait_for_step(opt)}
    interval = sys.getswitchinterval()
    _loss(model, 0, device).backward()
    opt.step()
    opt.zero_grad()
    assert ctl.stepping is not None, "zero_grad(set_to_none=True) must not wait"
    assert sys.getswitchinterval() < interval, "the GIL switch interval is lowered while the step runs on"
    for step, (what, call) in enumerate(waits.items(), start=1):
        _loss(model, step, device).backward()
        opt.step()
        assert ctl.stepping is not None, "step() should return with units still stepping"
        call()
        assert ctl.stepping is None, f"{what} did not wait for the step"
        _no_worker_left()
        opt.zero_grad()
    assert sys.getswitchinterval() == interval, "the interval is given back once the step is done"
    _slow_host_step(monkeypatch, fail_on=model._fsdp_engine.units[0].name)
    _loss(model, 9, device).backward()
    opt.step()
    with pytest.raises(ValueError, match="host step of .* failed"):
        _loss(model, 10, device)
    _no_worker_left()
    with pytest.raises(ValueError, match=r"overlap_step='forward'.*needs step='cpu', got step='gpu'"):
        fsdp_impl.OffloadPolicy(step="gpu", overlap_step="forward")
