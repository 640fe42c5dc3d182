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


def build_mesh(device_mesh: DeviceMesh | None, dp_shard_dim: str | None,
               tp_dim: str | None = None) -> tuple[DeviceMesh, DeviceMesh]:
    """Return ``(mesh, shard_mesh)`` after checking the mesh covers the world.

    ``device_mesh=None`` builds a mesh over the world, as Megatron-FSDP does: one dim named
    ``dp_shard_dim`` (default ``"dp_shard"``), plus a trivial size-1 dim named ``tp_dim`` when
    one is given (TE and Megatron layers expect a TP dim)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fully_shard needs an initialised default process group "
                           "(torch.distributed.init_process_group)")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch DeviceMesh or None, got {type(device_mesh).__name__}")
    check_dim_name(dp_shard_dim, "dp_shard_dim", device_mesh)
    check_dim_name(tp_dim, "tp_dim", device_mesh)
    world = dist.get_world_size()
    if device_mesh is None:
        dp_shard_dim = dp_shard_dim or MeshDim.DP_SHARD.value
        if tp_dim == dp_shard_dim:
            raise ValueError(f"tp_dim={tp_dim!r} must differ from dp_shard_dim={dp_shard_dim!r}")
        names = (dp_shard_dim,) if tp_dim is None else (dp_shard_dim, tp_dim)
        device_mesh = init_device_mesh(default_device_type(), (world,) + (1,) * (len(names) - 1),
                                       mesh_dim_names=names)
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
    """Process groups of the wrapped model (``model.dist_index``); ``None`` for parallelism not in
    use. The getters take Megatron-FSDP's ``is_expert_parallel`` / ``independent_all_gather``
    switches: expert params shard over ``expt_device_mesh[dp_shard_dim]``, and the param
    all-gathers run over ``fsdp_group_ag`` / ``expt_fsdp_group_ag`` when given."""

    def __init__(self, mesh: DeviceMesh, shard_mesh: DeviceMesh,
                 outer_group: dist.ProcessGroup | None = None,
                 hybrid_group: dist.ProcessGroup | None = None,
                 tp_group: dist.ProcessGroup | None = None,
                 fsdp_group_ag: dist.ProcessGroup | None = None,
                 expert: DistIndex | None = None) -> None:
        self.device_mesh = mesh
        self.shard_mesh = shard_mesh  # the dp_shard_dim sub-mesh (inner group, also under HFSDP)
        self._outer_group = outer_group
        self._hybrid_group = hybrid_group
        self._tp_group = tp_group
        self._fsdp_group_ag = fsdp_group_ag
        self._expert = expert  # the same index over expt_device_mesh (None: no expert parallelism)

    def _pick(self, is_expert_parallel: bool) -> DistIndex | None:
        return self._expert if is_expert_parallel else self

    @property
    def expt_device_mesh(self) -> DeviceMesh | None:
        return self._expert.device_mesh if self._expert is not None else None

    def get_fsdp_group(self, is_expert_parallel: bool = False,
                       independent_all_gather: bool = False) -> dist.ProcessGroup | None:
        """The dp_shard group (the param all-gather group with ``independent_all_gather``; ``None``
        when no separate one was given, as in Megatron-FSDP)."""
        index = self._pick(is_expert_parallel)
        if index is None:
            return None
        return index._fsdp_group_ag if independent_all_gather else index.shard_mesh.get_group()

    def get_outer_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        index = self._pick(is_expert_parallel)
        return index._outer_group if index is not None else None

    def get_hybrid_fsdp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        index = self._pick(is_expert_parallel)
        return index._hybrid_group if index is not None else None

    def get_dp_group(self, is_expert_parallel: bool = False) -> dist.ProcessGroup | None:
        """All data-parallel ranks: the hybrid group under HSDP/HFSDP, else the dp_shard group."""
        index = self._pick(is_expert_parallel)
        if index is None:
            return None
        return index._hybrid_group or index.shard_mesh.get_group()

    def get_root_mesh(self, is_expert_parallel: bool = False) -> DeviceMesh | None:
        index = self._pick(is_expert_parallel)
        return index.device_mesh if index is not None else None

    def get_tp_group(self) -> dist.ProcessGroup | None:
        return self._tp_group

    @property
    def shard_rank(self) -> int:
        return self.shard_mesh.get_local_rank()

    @property
    def shard_size(self) -> int:
        return self.shard_mesh.size()
