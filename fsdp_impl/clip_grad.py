"""Global gradient-norm clipping for FSDP models, on ``grad`` or ``decoupled_grad``.

Each rank holds only shards of DTensor gradients, so the norm is assembled from local partial
sums: ``sum |g|^p`` (or ``max |g|`` for the inf norm) over local shards, all-reduced over the
mesh dims where the gradient is sharded (replicated dims hold copies, so they are counted once).
Collectives are issued group by group in the order the parameters are given, which is the same
on every rank. Params without a gradient are skipped (grad presence is the same on every rank of
a DTensor) and None is never handed to a kernel (a fused norm kernel given None segfaults).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Shard

try:  # dp-over-tp row sharding (fsdp_impl.placement); not a Shard subclass on every torch
    from torch.distributed.tensor.placement_types import _StridedShard
    _SHARD_TYPES: tuple = (Shard, _StridedShard)
except ImportError:  # pragma: no cover - depends on the torch build
    _SHARD_TYPES = (Shard,)

from torch.distributed.tensor import DTensor

from fsdp_impl.decoupled import grad_attr_name, read_grad
from fsdp_impl.offload.overlap import clip_norm_lookup
from fsdp_impl.placement import local_tensor

__all__ = ["clip_grad_norm"]

# A local grad's norm computed earlier (norm type, accumulation dtype), or None
NormLookup = Callable[[torch.Tensor, float, torch.dtype], "torch.Tensor | None"]

# torch.nn.utils.clip_grad_norm_ uses the same epsilon; keeping it makes results comparable.
_CLIP_EPS = 1e-6


@dataclass
class _ReduceGroup:
    """Local gradients whose partial norms are reduced over the same process groups."""

    mesh: Any
    shard_dims: tuple[int, ...]
    tensors: list[torch.Tensor] = field(default_factory=list)


def _resolve(
    model_or_params: Any, use_decoupled_grad: bool | None
) -> tuple[list[torch.Tensor], bool]:
    """The params to clip and which gradient attribute to read."""
    if isinstance(model_or_params, torch.nn.Module):
        buffer = getattr(model_or_params, "param_and_grad_buffer", None)
        model_flag = getattr(buffer, "use_decoupled_grad", None) if buffer is not None else None
        if use_decoupled_grad is not None and isinstance(model_flag, bool):
            if use_decoupled_grad != model_flag:
                raise ValueError(
                    "Inconsistent decoupled gradients setting: clip_grad_norm was called with "
                    f"use_decoupled_grad={use_decoupled_grad} but the model's "
                    f"param_and_grad_buffer.use_decoupled_grad is {model_flag}; drop the "
                    "argument to follow the model, or wrap the model with the same setting"
                )
        flag = use_decoupled_grad if use_decoupled_grad is not None else bool(model_flag)
        return list(model_or_params.parameters()), flag
    if isinstance(model_or_params, torch.Tensor):
        params = [model_or_params]
    elif isinstance(model_or_params, Iterable):
        params = list(model_or_params)
    else:
        raise TypeError(
            "model_or_params must be an nn.Module, a Tensor or an iterable of Tensors, got "
            f"{type(model_or_params).__name__}"
        )
    return params, bool(use_decoupled_grad)


def _check_args(max_norm: float, norm_type: float, use_decoupled_grad: bool | None) -> float:
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
        raise ValueError(f"max_norm must be a non-negative real number, got {max_norm!r}")
    if math.isnan(max_norm) or max_norm < 0:
        raise ValueError(f"max_norm must be a non-negative real number, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
        raise ValueError(f"norm_type must be a positive real number or math.inf, got {norm_type!r}")
    norm = float(norm_type)
    if math.isnan(norm) or norm <= 0:
        raise ValueError(f"norm_type must be a positive real number or math.inf, got {norm_type!r}")
    if use_decoupled_grad is not None and not isinstance(use_decoupled_grad, bool):
        raise ValueError(f"use_decoupled_grad must be None, True or False, got {use_decoupled_grad!r}")
    return norm


def _group_grads(params: list[torch.Tensor], use_decoupled: bool) -> list[_ReduceGroup]:
    """Gradients grouped by the process groups their norms are reduced over, in param order.

    A list with a linear lookup (not a dict/set) keeps the order the params were given, which
    is what makes the collective sequence identical on every rank.
    """
    groups: list[_ReduceGroup] = []
    for index, param in enumerate(params):
        grad = read_grad(param, use_decoupled)
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            placements = tuple(grad.placements)
            if any(isinstance(p, Partial) for p in placements):
                raise ValueError(
                    f"parameter {index}: param.{grad_attr_name(use_decoupled)} has a Partial "
                    f"placement {placements}; reduce gradients before clipping"
                )
            mesh = grad.device_mesh
            shard_dims = tuple(d for d, p in enumerate(placements) if isinstance(p, _SHARD_TYPES))
        else:
            mesh, shard_dims = None, ()
        for group in groups:
            if group.mesh == mesh and group.shard_dims == shard_dims:
                group.tensors.append(local_tensor(grad))
                break
        else:
            groups.append(_ReduceGroup(mesh, shard_dims, [local_tensor(grad)]))
    return groups


def _acc_dtype(groups: list[_ReduceGroup]) -> torch.dtype:
    """fp64 if any gradient is fp64, else fp32 (low-precision grads are summed in fp32)."""
    wide = any(t.dtype == torch.float64 for g in groups for t in g.tensors)
    return torch.float64 if wide else torch.float32


def _local_partial(tensors: list[torch.Tensor], norm_type: float, dtype: torch.dtype,
                   cached: NormLookup | None = None) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|``) over local tensors; 0 for empty shards.

    Empty shards are left out (they contribute 0, and the inf norm rejects empty input) but the
    partial still exists, so ranks holding only empty shards join the collectives. ``cached``
    gives per-tensor norms computed during the backward (``OffloadPolicy(overlap_step="clip")``:
    the same ``_foreach_norm`` of the same tensors); the others are computed here, in one call.
    """
    device = tensors[0].device
    nonempty = [t for t in tensors if t.numel() > 0]
    if not nonempty:
        return torch.zeros((), dtype=dtype, device=device)
    found = [cached(t, norm_type, dtype) if cached is not None else None for t in nonempty]
    missing = [t for t, n in zip(nonempty, found, strict=True) if n is None]
    fresh = iter(torch._foreach_norm(missing, norm_type, dtype=dtype) if missing else [])
    norms = torch.stack([(n if n is not None else next(fresh)).to(device) for n in found])
    if math.isinf(norm_type):
        return norms.max()
    return (norms**norm_type).sum()


def _reduce(partial: torch.Tensor, group: _ReduceGroup, norm_type: float) -> torch.Tensor:
    """All-reduce over each sharded mesh dim, in ascending dim order."""
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    if group.shard_dims and partial.device.type != group.mesh.device_type:
        partial = partial.to(group.mesh.device_type)  # host grads (CPU offload): reduce on the mesh's device
    for dim in group.shard_dims:
        if group.mesh.size(dim) > 1:
            dist.all_reduce(partial, op=op, group=group.mesh.get_group(dim))
    return partial


def _total_norm(groups: list[_ReduceGroup], norm_type: float, cached: NormLookup | None = None) -> torch.Tensor:
    dtype = _acc_dtype(groups)
    total: torch.Tensor | None = None
    for group in groups:
        reduced = _reduce(_local_partial(group.tensors, norm_type, dtype, cached), group, norm_type)
        if total is None:
            total = reduced
        else:
            reduced = reduced.to(total.device)
            total = torch.maximum(total, reduced) if math.isinf(norm_type) else total + reduced
    assert total is not None
    return total if math.isinf(norm_type) else _root(total, norm_type)


def _root(total: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``total ** (1 / p)``. A CPU square root is taken in float64 on the host and rounded once
    to ``total``'s dtype: the correctly rounded root, as CUDA's ``sqrt`` and torch's own
    ``clip_grad_norm_`` (``vector_norm``) give. torch's CPU ``sqrt`` and ``pow(x, 0.5)`` run in
    MKL's vector math library, whose last bit depends on the CPU (measured: 1 in 7 roots differ
    from the correctly rounded one on an AMD AVX2 machine, and differently on emulated Intel CPUs),
    so a grad norm, and every clipped step after it, would not be the same on every machine."""
    if norm_type == 2.0 and total.device.type == "cpu" and total.numel() == 1:
        return torch.tensor(math.sqrt(float(total.item())), dtype=total.dtype)
    return total ** (1.0 / norm_type)


def clip_grad_norm(
    model_or_params: Any,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    *,
    use_decoupled_grad: bool | None = None,
) -> torch.Tensor:
    """Clip gradients in place to a global norm of at most ``max_norm``; return the norm.

    ``model_or_params``: an FSDP-wrapped model (its ``param_and_grad_buffer.use_decoupled_grad``
    picks ``decoupled_grad`` vs ``grad``), any module, a tensor or an iterable of params (these
    read ``.grad`` unless ``use_decoupled_grad=True``). The returned norm is computed over all
    ranks for DTensor gradients. Scaling follows ``torch.nn.utils.clip_grad_norm_``: by
    ``max_norm / (norm + 1e-6)`` clamped at 1. A non-finite norm raises ``RuntimeError`` when
    ``error_if_nonfinite`` is set; otherwise it warns, leaves the gradients unscaled and returns
    it. Checking finiteness costs one host sync.
    """
    norm = _check_args(max_norm, norm_type, use_decoupled_grad)
    params, use_decoupled = _resolve(model_or_params, use_decoupled_grad)
    groups = _group_grads(params, use_decoupled)
    if not groups:
        return torch.zeros(())
    cached = clip_norm_lookup(params)  # offload overlap_step: refuses, or the norms of the backward
    total = _total_norm(groups, norm, cached)
    if not bool(torch.isfinite(total)):
        message = (
            f"The total norm of order {norm_type} of the gradients (param."
            f"{grad_attr_name(use_decoupled)}) is non-finite ({total.item()}), so it cannot be "
            "clipped"
        )
        if error_if_nonfinite:
            raise RuntimeError(message + "; set error_if_nonfinite=False to only warn")
        warnings.warn(message + "; the gradients were left unscaled", RuntimeWarning, stacklevel=2)
        return total
    clip_coef = torch.clamp(max_norm / (total + _CLIP_EPS), max=1.0)
    for tensors in _by_device_and_dtype([t for g in groups for t in g.tensors if t.numel() > 0]):
        torch._foreach_mul_(tensors, clip_coef.to(device=tensors[0].device, dtype=tensors[0].dtype))
    return total


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Split ``tensors`` into same-device, same-dtype lists (what one foreach kernel accepts)."""
    buckets: list[list[torch.Tensor]] = []
    for tensor in tensors:
        for bucket in buckets:
            if bucket[0].device == tensor.device and bucket[0].dtype == tensor.dtype:
                bucket.append(tensor)
                break
        else:
            buckets.append([tensor])
    return buckets
