"""``OffloadPolicy(device_step_units=...)`` on a GPU (skips elsewhere naming CUDA).

On CPU (``test_offload_overlap.py``) the device is the host, so the units stepped "on the device"
run torch's fused CPU kernel, as the host step does. On a GPU they run the fused CUDA kernel on
copies uploaded from the host, inside the overlapped step, on a side stream. Its independent
reference is the same model without offload and ``Adam(fused=True)``: the same CUDA kernel on the
same grads, so every unit stepped on the device must equal it bit for bit (losses, params,
moments). A download that races the next upload, a missed stream wait or a stale copy ahead shows
as a difference of order lr = 1e-2.
"""
from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import fsdp_impl
from tests.functional import matrix_axes as axes
from tests.functional.common.offload import full_tensor, train
from tests.functional.common.reference import make_optimizer

pytestmark = [pytest.mark.requires_cuda, pytest.mark.distributed(world_size=1, timeout=600)]
OVERLAP_ATTR = "_fsdp_offload_overlap"


def _fused_adam(module: torch.nn.Module) -> torch.optim.Optimizer:
    """The suite's two-group Adam with torch's fused kernel (what step='cpu' picks on the host)."""
    opt = make_optimizer("adam", module.named_parameters())
    for group in opt.param_groups:
        group["fused"] = True
    return opt


def _moments(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: full_tensor(v) for k, v in opt.state[p].items() if k != "step"}
            for name, p in model.named_parameters()}


@pytest.mark.matrix(mesh=axes.mesh(1), zero="optim_grads_params", offload="cpu_overlap", dtype="bf16")
def test_all_units_stepped_on_the_gpu_equal_no_offload_with_the_fused_kernel(dist_env: Any) -> None:
    """device_step_units covering every unit, params=True, bf16 compute, ZeRO-3, 4 steps of two
    microbatches: losses, params and Adam moments equal the non-offloaded run with the same fused
    CUDA kernel bit for bit; the device step ran and no host step did."""
    device = dist_env.device
    ref = train("gpt", device, dict(zero_dp_strategy=3), steps=4, dtype=torch.bfloat16, make_opt=_fused_adam)
    policy = fsdp_impl.OffloadPolicy(step="cpu", pin_memory=True, overlap_step=True, params=True,
                                     device_step_units=99)
    run = train("gpt", device, dict(zero_dp_strategy=3, offload_policy=policy), steps=4, dtype=torch.bfloat16)
    assert run[0] == ref[0], f"losses {run[0]} != no offload's {ref[0]}"
    for name, value in ref[1].items():
        assert torch.equal(run[1][name], value), (
            f"{name} differs from no offload (max abs {(run[1][name] - value).abs().max().item():.3e})")
    got, want = _moments(run[3], run[2]), _moments(ref[3], ref[2])
    for name, entries in want.items():
        for key, value in entries.items():
            assert torch.equal(got[name][key], value), f"state {key} of {name} differs from no offload"
    phases = run[3].__dict__[OVERLAP_ATTR].last_times.phases
    assert phases.get("device_step", 0.0) > 0.0 and phases.get("step", 0.0) == 0.0, f"phases: {phases}"
    alive = [t.name for t in threading.enumerate() if t.name == "fsdp-offload-step"]
    assert not alive, f"overlap worker threads outlived the step: {alive}"
