"""The switches of Megatron-FSDP's ``fully_shard`` that map onto engine options here.

``WrapOptions`` validates them (bools only, hardware-only ones refused with what is missing)
before anything is allocated, and says what each one becomes:

* ``overlap_grad_reduce`` / ``overlap_param_gather``: collectives on side streams (CUDA), or on
  the compute stream, in order with the compute, when off; ``overlap_param_gather=False`` also
  stops ZeRO-3 from prefetching the next unit's all-gather.
* ``average_in_collective`` / ``calculate_per_token_loss``: ``grad_reduce.GradScaling``.
* ``fsdp_double_buffer`` / ``maxpool_double_buffer`` (and ``nccl_ub``, which implies the double
  buffer in Megatron-FSDP): ZeRO-3 units gather into a fixed pool sized for the largest unit
  instead of allocating per unit. The pool fits every unit, so
  ``fsdp_db_use_persist_buf_on_alloc_fail`` (Megatron's fallback for a unit that does not fit)
  never has anything to do. With ZeRO-0/1/2 the compute params are persistent already.
* ``disable_bucketing``: the params outside every unit form one bucket (the root unit) either
  way, which is what Megatron-FSDP's ``fully_shard`` does for both values.
* ``preproc_state_dict_for_dcp_ckpt``: the model's state dict is DCP-ready as it is (uneven
  shards are ordinary ``Shard(0)`` DTensors); for the optimizer see ``dcp_optim_state``.
* ``enable_fine_grained_param_gather``: Megatron-FSDP 0.6.1's per-submodule unshard hooks. Every
  submodule of a unit that holds params gets a pre-forward hook that unshards what its own params
  need (here: its unit, the gather bucket, as Megatron-FSDP's buckets are per unit and dtype), so
  a ZeRO-3 unit is gathered when its first submodule with params runs rather than when the unit
  is entered, and a submodule recomputed on its own inside the backward finds its params.
* ``nccl_ub`` (NCCL user-buffer registration): not implemented; ``True`` raises naming what is
  missing. ``disable_symmetric_registration`` only modifies ``nccl_ub``'s registration.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .device import pick_device


@dataclass(frozen=True)
class WrapOptions:
    """The boolean switches, in ``fully_shard``'s order."""

    overlap_grad_reduce: bool = True
    overlap_param_gather: bool = True
    preproc_state_dict_for_dcp_ckpt: bool = True
    average_in_collective: bool = False
    disable_bucketing: bool = False
    calculate_per_token_loss: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    disable_symmetric_registration: bool = False
    enable_fine_grained_param_gather: bool = False
    maxpool_double_buffer: bool = False

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, bool):
                raise TypeError(f"{f.name} must be True or False, got {value!r}")
        if self.nccl_ub:
            backend = str(dist.get_backend()).lower() if dist.is_initialized() else "none"
            missing = ("the engine does not register its communication buffers with NCCL yet"
                       if "nccl" in backend else
                       f"it needs the NCCL backend (this process group uses {backend!r})")
            raise NotImplementedError(
                f"nccl_ub=True (NCCL user-buffer registration of the FSDP buffers) is not supported: "
                f"{missing}; pass nccl_ub=False (fsdp_double_buffer=True gives the fixed buffer pool alone)")

    @property
    def unshard_pool(self) -> bool:
        """ZeRO-3 units gather into one fixed pool instead of allocating per unit."""
        return self.fsdp_double_buffer or self.maxpool_double_buffer


def resolve_device(device: object, mesh: DeviceMesh) -> torch.device:
    """``device`` (fully_shard's argument) checked against the mesh: it must be of the mesh's
    device type; ``None`` or an index-less device means the current device of that type."""
    default = pick_device(mesh)
    if device is None:
        return default
    try:
        resolved = torch.device(device)  # type: ignore[call-overload]
    except (TypeError, RuntimeError) as err:
        raise TypeError(f"device must be a torch.device, a device string or None, got {device!r}") from err
    if resolved.type != default.type:
        raise ValueError(f"device={str(resolved)!r} does not match the device mesh, whose device type is "
                         f"{mesh.device_type!r}; allowed values: None or a {mesh.device_type!r} device "
                         f"(e.g. {str(default)!r})")
    if resolved.index is not None and default.index is not None and resolved.index != default.index:
        raise ValueError(f"device={str(resolved)!r} is not this rank's current device {str(default)!r}; the "
                         "process group communicates on the current device: pass None or "
                         f"{str(default)!r}, or set the current device first")
    return default
