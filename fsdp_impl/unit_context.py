"""What every unit of one model shares (``UnitContext``): its configuration, where it runs, how
it shards and communicates. The switches are read from the ``FSDPConfig`` under their
``fully_shard`` names; the ZeRO level through the context's predicates."""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .device import CommStreams
from .grad_reduce import GradScaling, TwoLevelGroups
from .placement import PlacementPlan
from .policy import ShardingStrategy
from .unshard_storage import UnshardStorage

if TYPE_CHECKING:
    from .config import FSDPConfig
    from .fp8.params import UnitFp8
    from .nccl_ub import UserBuffers
    from .unit import FSDPUnit


@dataclass
class UnitContext:
    """What every unit of one model shares: its configuration, where it runs and how it shards.
    The switches are read from ``config`` under their ``fully_shard`` names; the ZeRO level
    through the predicates below."""

    config: FSDPConfig
    shard_mesh: DeviceMesh
    group: dist.ProcessGroup
    plan: PlacementPlan  # the meshes/placements the sharded params and grads are DTensors on
    rank: int  # rank inside the shard group
    world: int  # size of the shard group
    device: torch.device
    streams: CommStreams
    # HFSDP two-level grad reduction: reduce-scatter inside dp_shard every backward, across
    # dp_outer only on the sync backward (``None``: one reduction over ``group``).
    two_level: TwoLevelGroups | None = None
    # How grads are scaled and reduced, and the group of the param all-gathers (fsdp_group_ag;
    # ``None``: ``group``).
    grad_scaling: GradScaling = GradScaling()
    gather_group: dist.ProcessGroup | None = None
    # FP8 params: builds a unit's FP8 side once it has sharded (fp8.params.unit_fp8); None: no FP8
    fp8_setup: Callable[[FSDPUnit], UnitFp8 | None] | None = None
    # nccl_ub: the NCCL memory pool every communication buffer comes from (nccl_ub.py).
    user_buffers: UserBuffers | None = None
    # Set by fsdp_impl.cuda_graph.capture_train_step while it captures (see FSDPUnit._capture_token).
    capture_token: object | None = None

    @property
    def unshard(self) -> UnshardStorage:
        """How ZeRO-3 compute params are stored while unsharded (resolved: never AUTO)."""
        return self.config.unshard

    @unshard.setter
    def unshard(self, storage: UnshardStorage) -> None:
        self.config = self.config.with_unshard(storage)

    @property
    def zero3(self) -> bool:
        """``optim_grads_params``: compute params exist only while gathered."""
        return self.config.strategy == ShardingStrategy.OPTIM_GRADS_PARAMS

    @property
    def shards_grads(self) -> bool:
        """ZeRO-2/3: grads are reduce-scattered every backward (else accumulated until the sync one)."""
        return self.config.strategy >= ShardingStrategy.OPTIM_GRADS

    @property
    def refreshes(self) -> bool:
        """ZeRO-1/2: persistent compute params rebuilt by a gather when the main weights changed."""
        return self.config.strategy in (ShardingStrategy.OPTIM, ShardingStrategy.OPTIM_GRADS)

    @property
    def no_shard(self) -> bool:
        """ZeRO-0: every rank holds every param (layouts of one shard)."""
        return self.config.strategy == ShardingStrategy.NO_SHARD

    @property
    def fixed_buffers(self) -> bool:
        """Communication buffers live as long as the model (CUDA graphs, NCCL user buffers)."""
        return self.config.cuda_graph_mode or self.user_buffers is not None

    def comm_allocation(self) -> contextlib.AbstractContextManager[None]:
        """Where a communication buffer allocated now comes from (the NCCL pool, if any)."""
        return self.user_buffers.allocating() if self.user_buffers is not None else contextlib.nullcontext()

    @property
    def num_shards(self) -> int:
        """Shards of the weight/grad layouts: 1 for no_shard (every rank holds everything)."""
        return 1 if self.no_shard else self.world

    @property
    def layout_rank(self) -> int:
        return 0 if self.no_shard else self.rank
