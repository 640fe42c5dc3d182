"""How a managed parameter's shards are described as DTensors (mesh + placements).

The unit's flat buffers only know "this rank's rows of a tensor". This module decides what
tensor those rows belong to and on which mesh, so the optimizer, ``clip_grad_norm`` and DCP see
the truth:

* plain FSDP: ``Shard(0)`` (``Replicate()`` for no_shard) over the dp-shard dim;
* HSDP: ``[Replicate(), Shard(0)]`` over ``(dp_outer, dp_shard)``: the replicas are explicit;
* HFSDP: ``Shard(0)`` over the hybrid (dp_outer x dp_shard) dim;
* tensor-parallel DTensor params (``parallelize_module``): FSDP shards the TP-*local* tensor by
  rows, and the sharded param is a DTensor over ``(dp dims..., tp)``: ``[..., Shard(0), Shard(1)]``
  for a row-wise TP weight, ``[..., _StridedShard(0, split_factor=tp), Shard(0)]`` for a
  column-wise one (TP splits rows first, FSDP then splits each TP chunk: the layout FSDP2 uses).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, placement_types
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from .buffers import contiguous_stride
from .mesh import mesh_dim_names, submesh


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of a DTensor (a view, updatable in place), else the tensor itself.

    ``_local_tensor`` is used instead of ``to_local()`` because it never goes through autograd
    and is always the very tensor the DTensor wraps, including empty shards.
    """
    if isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor

# Private, but what FSDP2 itself uses for dp-over-tp row sharding (present in torch 2.11 and
# 2.13); None on a build without it, which then refuses row-sharded TP params.
_STRIDED_SHARD: Callable[..., Placement] | None = getattr(placement_types, "_StridedShard", None)


def _mesh_ranks(mesh: DeviceMesh) -> list[int]:
    return sorted(int(r) for r in mesh.mesh.flatten().tolist())


@dataclass(frozen=True)
class TPSpec:
    """A tensor-parallel parameter: its 1-D TP mesh and placement, global and TP-local shape."""

    mesh: DeviceMesh
    placement: Placement  # Shard(d) or Replicate()
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]

    def local_chunk(self, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's part of a full (global) tensor, with DTensor's torch.chunk semantics."""
        if not isinstance(self.placement, Shard):
            return full
        dim, n, r = self.placement.dim, self.mesh.size(), self.mesh.get_local_rank()
        chunks = torch.chunk(full, n, dim=dim)
        return chunks[r] if r < len(chunks) else full.narrow(dim, 0, 0)

    def to_compute(self, local: torch.Tensor) -> DTensor:
        """The TP DTensor the module computes with (its local tensor is ``local``)."""
        return DTensor.from_local(local, self.mesh, [self.placement], run_check=False,
                                  shape=torch.Size(self.global_shape),
                                  stride=contiguous_stride(self.global_shape))

    def local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The TP-local grad (a Partial grad, e.g. of a replicated bias, is reduced first)."""
        if not isinstance(grad, DTensor):
            return grad
        if tuple(grad.placements) != (self.placement,):
            grad = grad.redistribute(grad.device_mesh, [self.placement])
        return grad.to_local()


def tp_spec_of(name: str, param: nn.Parameter, tp_mesh: DeviceMesh | None,
               tp_dim: str | None) -> TPSpec | None:
    """``None`` for a plain param; the TP facts of a DTensor param after checking it composes."""
    if not isinstance(param, DTensor):
        return None
    where = f"parameter {name!r} is a DTensor on mesh dims {param.device_mesh.mesh_dim_names} " \
            f"(placements {tuple(param.placements)})"
    if tp_mesh is None:
        raise ValueError(f"{where} but tp_dim is None; pass tp_dim naming the tensor-parallel dim "
                         "of device_mesh it was distributed over")
    if param.device_mesh.ndim != 1 or _mesh_ranks(param.device_mesh) != _mesh_ranks(tp_mesh):
        raise ValueError(f"{where}; tensor-parallel params must live on the 1-D tp_dim={tp_dim!r} "
                         f"sub-mesh (ranks {_mesh_ranks(tp_mesh)}) of device_mesh")
    placement = param.placements[0]
    if not (type(placement) is Shard or isinstance(placement, Replicate)):
        raise ValueError(f"{where}; allowed tensor-parallel placements: Shard(dim), Replicate()")
    if isinstance(placement, Shard) and placement.dim == 0 and tp_mesh.size() > 1 and _STRIDED_SHARD is None:
        raise NotImplementedError(f"{where}; row-sharded (Shard(0)) TP params need "
                                  "torch.distributed.tensor.placement_types._StridedShard, which this "
                                  "torch build lacks; row-sharded TP params are not supported on it")
    local = tuple(param.to_local().shape)
    if len(local) == 0:
        raise ValueError(f"{where} is 0-dimensional; fully_shard needs params with at least one dim")
    return TPSpec(tp_mesh, placement, tuple(param.shape), local)


class PlacementPlan:
    """The meshes and placements of every sharded param/grad of one wrapped model.

    ``dp_mesh`` holds the data-parallel dims (outermost first) and ``dp_names`` their names in
    the root mesh (``None`` when the dp mesh came from a bare process group, which then cannot be
    combined with a tp dim); ``replicate_outer`` marks HSDP's leading replica dim.
    """

    def __init__(self, root: DeviceMesh, dp_mesh: DeviceMesh, dp_names: Sequence[str] | None,
                 replicate_outer: bool, sharded: bool, tp_dim: str | None) -> None:
        self.root = root
        self.dp_mesh = dp_mesh
        self.dp_names = tuple(dp_names) if dp_names is not None else None
        self.replicate_outer = replicate_outer
        self.sharded = sharded  # False for no_shard: every dp rank holds everything
        self.tp_dim = tp_dim
        self._tp_mesh: DeviceMesh | None = None

    def _dp_placements(self, tp: TPSpec | None) -> list[Placement]:
        inner: Placement = Replicate()
        if self.sharded:
            inner = Shard(0)
            if tp is not None and isinstance(tp.placement, Shard) and tp.placement.dim == 0 \
                    and tp.mesh.size() > 1:
                assert _STRIDED_SHARD is not None  # tp_spec_of refuses such params without it
                inner = _STRIDED_SHARD(0, split_factor=tp.mesh.size())
        return ([Replicate()] if self.replicate_outer else []) + [inner]

    def _mesh_with_tp(self) -> DeviceMesh:
        if self._tp_mesh is None:
            if self.dp_names is None:
                raise ValueError("tensor-parallel DTensor params need the hybrid_fsdp_group to be a "
                                 "flattened dim of device_mesh (e.g. mesh['hsdp'].get_group()), so the "
                                 "sharded params can be DTensors over (hsdp, tp)")
            if self.tp_dim is None:
                raise ValueError("tensor-parallel DTensor params need tp_dim naming their mesh dim")
            self._tp_mesh = self.root[self.dp_names + (self.tp_dim,)]
        return self._tp_mesh

    def mesh_and_placements(self, tp: TPSpec | None) -> tuple[DeviceMesh, list[Placement]]:
        if tp is None:
            return self.dp_mesh, self._dp_placements(None)
        return self._mesh_with_tp(), self._dp_placements(tp) + [tp.placement]

    def check(self, specs: Sequence[TPSpec | None]) -> None:
        """Build the (dp..., tp) mesh now if any param needs it, so errors come at wrap time."""
        if any(s is not None for s in specs):
            self._mesh_with_tp()

    def wrap(self, local: torch.Tensor, tp: TPSpec | None, shape: Sequence[int]) -> DTensor:
        """A DTensor view of this rank's ``local`` rows of a tensor of global ``shape``. A local
        tensor in host memory while the mesh is on a device (CPU offload) stays where it is
        (``DTensor.from_local`` would copy it to the device), as FSDP2's offloaded params do."""
        mesh, placements = self.mesh_and_placements(tp)
        if local.device.type != mesh.device_type and not local.is_meta:
            meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype)
            spec = DTensorSpec(mesh, tuple(placements), tensor_meta=meta)
            return DTensor(local, spec, requires_grad=False)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                                  stride=contiguous_stride(shape))


def find_flattened_dim(root: DeviceMesh, group: dist.ProcessGroup) -> str | None:
    """The name of a dim (own or flattened) of ``root`` whose ranks here are exactly ``group``'s."""
    want = sorted(dist.get_process_group_ranks(group))
    for name in mesh_dim_names(root):
        try:
            sub = submesh(root, name, "hybrid_fsdp_group")
        except ValueError:
            continue
        if sub.ndim == 1 and _mesh_ranks(sub) == want:
            return name
    return None
