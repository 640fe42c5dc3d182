"""A unit's all-gather of its weight shards, apart from the unit's state machine (``unit.py``):
the record of a gather in flight and the compute-dtype collective itself."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .sharding import FlatLayout


@dataclass
class Gather:
    """An all-gather in flight: its output, the event that marks it done, the weights' version.
    One rank (no offload): no event, the copy-out reads on the compute stream from the weight
    shard itself (main dtype); with FP8 params ``gathered`` is the unit's own FP8 segment and
    ``direct`` says the other params are copied from their main shards."""

    gathered: torch.Tensor
    event: torch.cuda.Event | None
    version: int
    direct: bool = False


def gather_in_compute_dtype(source: torch.Tensor, layout: FlatLayout, compute: torch.dtype,
                            group: dist.ProcessGroup, in_place: bool) -> torch.Tensor:
    """All-gather the shards (``source``: this rank's, on the device) in the compute dtype. With
    ``in_place`` (a cast is needed and this rank's chunk of the output is its own layout segment)
    the shard is cast straight into that chunk and gathered in place (FSDP2 does the same): no
    separate low-precision copy of the shard, no input segment for the collective to copy."""
    gathered = torch.empty(layout.total_numel, dtype=compute, device=source.device)
    if source.dtype == compute:  # nothing to cast: gather straight from the shard
        comm.all_gather(gathered, source, group)
    elif in_place:
        local = gathered.narrow(0, group.rank() * layout.segment_numel, layout.segment_numel)
        local.copy_(source)
        comm.all_gather(gathered, local, group)
    else:
        comm.all_gather(gathered, source.to(compute), group)
    return gathered
