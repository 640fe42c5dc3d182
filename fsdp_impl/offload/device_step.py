"""The device step of chosen units inside the overlapped host step (``OffloadPolicy.device_step_units``).

With ``step="cpu"`` and ``overlap_step=True`` at large sizes the step is the worker's host Adam: it
reads and writes 28 bytes a param of host memory beside the step's DMA. A unit stepped here
instead costs the host no Adam pass: on a side stream (``OverlappedStep.device_stream``) its
fp32 shard, grads and moments go up, the optimizer's own kernel (``optim.user_kernel``: the
group's flags, the cycle's hyper-parameters) runs on the device copies, and the new shard and
moments come back down; the new shard, cast to the compute dtype on the device, is the copy the
next forward's gather takes (``UnitOffload.device_stepped``), so nothing is uploaded for it. The
worker does not wait for the link: it goes on with the host steps of other units, and
``optimizer.step()`` waits for every download (``OverlappedStep`` keeps their events) before it
returns, so host state read after ``step()`` is final. The next upload of the shard (the
backward's gather) waits for its download on the device.

Bits: the kernel is the same, but on another device: on CPU (tests) that is the host, so the
numbers equal the host step's bit for bit; on a GPU they are the device kernel's, which may
round differently from torch's CPU kernel in the last bit (as the non-offloaded step would).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version

from ..device import CommStream
from ..placement import local_tensor
from .optim import GradOf, _device_step, _init_host_state, host_zeros_like, user_class, user_kernel
from .step import GRAD, PARAM, STATE_KINDS, ChunkKind, StreamEntry

if TYPE_CHECKING:
    from ..param import ManagedParam
    from ..unit import FSDPUnit


def device_step_unit(optimizer: torch.optim.Optimizer, unit: FSDPUnit, grad_of: GradOf,
                     hyper: list[dict[str, Any]], stream: CommStream, landed: Any) -> Any:
    """Step ``unit``'s params on the device (worker thread); returns the event of the downloads
    (None on CPU), which the caller waits for before the host reads the shard or the moments."""
    offload = unit.offload
    assert offload is not None
    cls = user_class(optimizer)
    owned = {id(mp.sharded): mp for mp in unit.trainable}
    host_weight = offload.weight.data
    counters: list[torch.Tensor] = []
    with stream.enter():
        stream.wait(landed)  # the unit's grads are on the host and its backward is done
        weight = offload.upload(host_weight)
        downloads: list[tuple[torch.Tensor, torch.Tensor]] = [(host_weight, weight)]
        for gi, group in enumerate(optimizer.param_groups):
            items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]] = []
            for p in group["params"]:
                mp = owned.get(id(p))
                if mp is None:
                    continue
                state = optimizer.state[p]
                if len(state) == 0:
                    _init_host_state(optimizer, cls, group, p, unit, mp)
                    _pin_moments(state, unit, mp, offload.non_blocking)
                views = {PARAM: _device_view(weight, host_weight, local_tensor(p)),
                         GRAD: offload.upload(grad_of(unit, mp).reshape(-1)).view(local_tensor(p).shape)}
                for key in STATE_KINDS:
                    if key in state:
                        host = local_tensor(state[key])
                        views[key] = offload.upload(host.reshape(-1)).view(host.shape)
                        downloads.append((host, views[key]))
                step = state["step"]
                staged = _stage(step, offload.device, offload.non_blocking) if _device_step(group) else step
                counters.append(step)
                items.append((StreamEntry(gi, views, None, {"step": step, "staged": staged}), views))
            if items:
                user_kernel(optimizer, cls, gi, items, hyper[gi])
        ahead = weight.to(offload.compute_dtype)
        ready = stream.record()  # the next forward's gather waits for the cast, not the downloads
        for host, device_copy in downloads:
            host.copy_(device_copy.reshape(host.shape), non_blocking=offload.non_blocking)
        done = stream.record()
    with torch.no_grad():
        for step in counters:
            step.add_(1)
    increment_version(unit.weight.data)  # what note_optimizer_step does, for this unit
    offload.device_stepped(ahead, stream, ready, done)
    return done


def _device_view(weight: torch.Tensor, host_weight: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Param ``local``'s slice (a view of the host shard) in the shard's device copy."""
    start = (local.data_ptr() - host_weight.data_ptr()) // local.element_size()
    if not (0 <= start and start + local.numel() <= host_weight.numel()) or not local.is_contiguous():
        raise RuntimeError("OffloadPolicy(device_step_units=...): a param is not a contiguous view of its "
                           "unit's host shard")
    return weight[start:start + local.numel()].view(local.shape)


def _stage(step: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """The pre-step counter on the device (fused/capturable kernels read it there), copied from
    page-locked memory: a copy from pageable memory would wait for the side stream's earlier work."""
    value = step.detach().reshape(())
    return (value.pin_memory() if pin else value).to(device, non_blocking=pin)


def _pin_moments(state: dict[str, Any], unit: FSDPUnit, mp: ManagedParam, pin: bool) -> None:
    """Fresh moments in page-locked memory (the lazy init's ``zeros_like`` is pageable, and a
    copy from pageable memory blocks the worker)."""
    for key in STATE_KINDS:
        if key in state:
            state[key] = host_zeros_like(state[key], unit, mp, pin)


__all__ = ["device_step_unit"]
