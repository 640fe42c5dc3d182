"""Device-mesh validation and the process-group index exposed as ``model.dist_index``."""
from __future__ import annotations

import enum

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .device import default_device_type


class MeshDim(str, enum.Enum):
    """Names of the mesh dims the engine creates itself. (``str, Enum`` rather than
    ``enum.StrEnum``, which needs Python 3.11.) Pass ``.value`` wherever torch stores or prints
    the name: a member's ``repr`` is the enum's, not the string's."""

    DP_SHARD = "dp_shard"  # the one dim of the mesh built for device_mesh=None
    HSDP = "hsdp"  # HFSDP's shard mesh built from a bare hybrid_fsdp_group

    def __str__(self) -> str:
        return self.value


def mesh_dim_names(mesh: DeviceMesh) -> list[str]:
    """Dim names addressable on ``mesh``: its own and those flattened from it."""
    names = list(mesh.mesh_dim_names or ())
    for attr in ("_flatten_mapping",):  # torch >= 2.6 keeps flattened sub-meshes here
        mapping = getattr(mesh, attr, None)
        if isinstance(mapping, dict):
            names.extend(sorted(mapping.keys()))
    return names


def submesh(mesh: DeviceMesh, name: str, arg_name: str) -> DeviceMesh:
    """``mesh[name]`` or an error naming the argument and the dims that exist."""
    check_dim_name(name, arg_name, mesh)
    try:
        return mesh[name]
    except (KeyError, RuntimeError, ValueError) as err:
        raise ValueError(f"{arg_name}={name!r} is not a dim of the device mesh; allowed values: "
                         f"{mesh_dim_names(mesh)}") from err


def check_dim_name(name: object, arg_name: str, mesh: DeviceMesh | None = None) -> None:
    """A mesh dim argument is a dim name (str) or None; anything else (e.g. an index) is refused
    here, before torch's indexing turns it into an unrelated error."""
    if name is None or isinstance(name, str):
        return
    allowed = f"{mesh_dim_names(mesh)} or None" if mesh is not None else "a str or None"
    raise TypeError(f"{arg_name} must name a dim of the device mesh (a str), got {name!r} of type "
                    f"{type(name).__name__}; allowed values: {allowed}")


def build_mesh(device_mesh: DeviceMesh | None, dp_shard_dim: str | None) -> tuple[DeviceMesh, DeviceMesh]:
    """Return ``(mesh, shard_mesh)`` after checking the mesh covers the world."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised default process group "
                           "(torch.distributed.init_process_group)")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch DeviceMesh or None, got {type(device_mesh).__name__}")
    check_dim_name(dp_shard_dim, "dp_shard_dim", device_mesh)
    world = dist.get_world_size()
    if device_mesh is None:
        default = MeshDim.DP_SHARD.value
        if dp_shard_dim is not None and dp_shard_dim != default:
            raise ValueError(f"dp_shard_dim={dp_shard_dim!r} given without a device_mesh; with "
                             "device_mesh=None the built mesh has one dim: allowed values: "
                             f"[{default!r}, None]")
        device_mesh = init_device_mesh(default_device_type(), (world,), mesh_dim_names=(default,))
        dp_shard_dim = default
    if device_mesh.size() != world:
        raise ValueError(f"device_mesh has {device_mesh.size()} ranks (shape "
                         f"{tuple(device_mesh.shape)}) but the world has {world}; the mesh must cover "
                         "every rank of the default process group")
    if dp_shard_dim is None:
        if device_mesh.ndim != 1:
            raise ValueError(f"dp_shard_dim must name the data-parallel shard dim of a "
                             f"{device_mesh.ndim}-D mesh; allowed values: {mesh_dim_names(device_mesh)}")
        return device_mesh, device_mesh
    return device_mesh, submesh(device_mesh, dp_shard_dim, "dp_shard_dim")


class DistIndex:
    """Process groups of the wrapped model; ``None`` for parallelism not in use."""

    def __init__(self, mesh: DeviceMesh, shard_mesh: DeviceMesh,
                 outer_group: dist.ProcessGroup | None = None,
                 hybrid_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        self.device_mesh = mesh
        self.shard_mesh = shard_mesh  # the dp_shard_dim sub-mesh (inner group, also under HFSDP)
        self._outer_group = outer_group
        self._hybrid_group = hybrid_group
        self._tp_group = tp_group

    def get_fsdp_group(self) -> dist.ProcessGroup:
        return self.shard_mesh.get_group()

    def get_outer_fsdp_group(self) -> dist.ProcessGroup | None:
        return self._outer_group

    def get_hybrid_fsdp_group(self) -> dist.ProcessGroup | None:
        return self._hybrid_group

    def get_tp_group(self) -> dist.ProcessGroup | None:
        return self._tp_group

    @property
    def shard_rank(self) -> int:
        return self.shard_mesh.get_local_rank()

    @property
    def shard_size(self) -> int:
        return self.shard_mesh.size()
