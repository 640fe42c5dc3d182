"""How a unit's gradients get reduced across the data-parallel groups.

A unit hands its full-size grads (every trainable param packed into its padded slots of the
unit's ``FlatLayout``: ``[n, segment]`` for ``n`` shards) to its reducer, which adds the average
over the data-parallel ranks into the unit's main-grad shard (``DataParallelBuffer``):

* ``ShardGroupReduce`` (plain FSDP, HSDP's inner level, CP through a flattened dim): one
  reduce-scatter (AVG) over the shard group, or an all-reduce (AVG) for no_shard.
* ``TwoLevelReduceScatter`` (HFSDP, shard group = hybrid group = dp_outer x dp_shard): a
  reduce-scatter inside dp_shard every backward, accumulated, and one across dp_outer on the
  sync backward only, so grad traffic crosses dp_outer once per optimisation cycle.
* ``OuterGradReducer`` (HSDP, units shard inside dp_shard and every dp_outer replica holds the
  same shards): on the sync backward, after every unit's shard-group reduction, each unit's
  main-grad shard is all-reduced (AVG) across dp_outer. AVG is linear, so reducing the
  accumulated sum once equals reducing every microbatch.

How the ranks' grads are combined is a ``GradScaling`` (fully_shard's ``average_in_collective``
and ``calculate_per_token_loss``): by default each rank's grads are divided by the
data-parallel size first and then summed (``SUM``); ``average_in_collective`` averages in the
collective instead (``AVG``, the same result up to rounding); ``calculate_per_token_loss``
sums without any division (the loss is already normalised by the global token count).
Expert-parallel units divide by the (non-expert) data-parallel size too although they reduce
over the smaller expert-data-parallel group, because every expert grad already holds the
contributions of its expert-parallel peers' tokens.

Reductions run on the model's reduce stream (a no-op on CPU); each ``reduce`` returns the event
that marks it done. Every rank calls them in the engine's unit order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .buffers import DataParallelBuffer
from .device import CommStream
from .parallel_dims import ParallelDims


@dataclass(frozen=True)
class GradScaling:
    """How a unit's grads are combined over the data-parallel ranks: multiply the local grads by
    ``pre_scale`` (``None`` or 1: not at all), then reduce with ``AVG`` (``average``) or
    ``SUM``. Every level of a reduction (dp_shard, then dp_outer) uses the same op; only the
    first pre-scales."""

    average: bool = True
    pre_scale: float | None = None

    @classmethod
    def for_units(cls, average_in_collective: bool, per_token_loss: bool, dp_size: int,
                  reduce_size: int) -> GradScaling:
        """The scaling of units whose grads reduce over ``reduce_size`` ranks of a model
        trained data-parallel over ``dp_size`` ranks (equal except for expert units)."""
        if per_token_loss:
            return cls(average=False)
        if average_in_collective:
            return cls(average=True, pre_scale=reduce_size / dp_size)
        return cls(average=False, pre_scale=1.0 / dp_size)

    @property
    def op(self) -> dist.ReduceOp.RedOpType:
        return dist.ReduceOp.AVG if self.average else dist.ReduceOp.SUM

    def prepare(self, full: torch.Tensor) -> None:
        """Pre-scale ``full`` (a temporary the reducer owns) in place."""
        if self.pre_scale is not None and self.pre_scale != 1.0:
            full.mul_(self.pre_scale)


@dataclass(frozen=True)
class TwoLevelGroups:
    """HFSDP's two grad-reduction levels: ``inner`` = dp_shard (x cp), ``outer`` = dp_outer."""

    inner: dist.ProcessGroup
    outer: dist.ProcessGroup


def two_level_groups(dims: ParallelDims, device: torch.device) -> TwoLevelGroups | None:
    """HFSDP: the groups of the two-level grad reduction, or ``None`` when not HFSDP or the
    hybrid group's rank order does not nest (outer-major). Every rank must take the same branch
    (the collectives differ), so the ranks agree with one MIN all-reduce over the world."""
    if dims.shard_group is None or dims.outer_group is None:
        return None
    inner = dims.inner_mesh.get_group()
    nests = dist.get_rank(dims.shard_group) == (dist.get_rank(dims.outer_group) * dist.get_world_size(inner)
                                                + dist.get_rank(inner))
    flag = torch.tensor([int(nests)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return TwoLevelGroups(inner, dims.outer_group) if flag.item() else None


class ShardGroupReduce:
    """One level: average over the shard group straight into the unit's grad shard."""

    def __init__(self, group: dist.ProcessGroup, all_reduce: bool, stream: CommStream,
                 device: torch.device, scaling: GradScaling = GradScaling()) -> None:
        self.group = group
        self.all_reduce = all_reduce  # no_shard: every rank keeps the whole (averaged) grad
        self.stream = stream
        self.device = device
        self.scaling = scaling
        self.solo = comm.solo(group)

    def reduce(self, full: torch.Tensor, grad: DataParallelBuffer, sync: bool,
               overwrite: bool = False) -> torch.cuda.Event | None:
        """Reduce ``full`` (every backward; ``sync`` does not matter for one level). Into a grad
        buffer that ``zero_grad(set_to_none=True)`` freed, or that holds nothing but the zeros of
        ``zero_grad(set_to_none=False)`` (``overwrite``, see ``DataParallelBuffer.take_zeroed``),
        the result is written directly (same values as adding it to zeros) instead of through a
        temporary and an add."""
        fresh = grad.allocate_for_overwrite() or overwrite
        if self.solo:  # one rank: the reduction is the identity (comm.solo), a local copy or add
            self.scaling.prepare(full)  # on the compute stream, like the grads it reads: no event
            if fresh:
                grad.data.copy_(full)
            else:
                grad.data.add_(full)
            return None
        with self.stream.use():
            self.scaling.prepare(full)
            if self.all_reduce:
                comm.all_reduce_op(full, self.group, self.scaling.op)
                if fresh:
                    grad.data.copy_(full)
                else:
                    grad.data.add_(full)
            elif fresh and full.dtype == grad.dtype:
                comm.reduce_scatter_op(grad.data, full, self.group, self.scaling.op)
            else:
                out = torch.empty(grad.layout.segment_numel, dtype=full.dtype, device=self.device)
                comm.reduce_scatter_op(out, full, self.group, self.scaling.op)
                if fresh:
                    grad.data.copy_(out)
                else:
                    grad.data.add_(out)
        self.stream.keep_alive(full)
        return self.stream.record()

    def direct_target(self, grad: DataParallelBuffer, dtype: torch.dtype, overwrite: bool) -> torch.Tensor | None:
        """Where the unit may pack its grads as the finished result, or None. On one rank the
        reduce-scatter is the identity, so when the result would overwrite the grad buffer
        (freed, or holding only zeros: ``overwrite``) in its own dtype, the grads are packed
        straight into it and pre-scaled there (``finish_direct``): the same values as packing into
        a temporary, scaling it and copying it over, without the temporary and the copy."""
        if not self.solo or self.all_reduce or dtype != grad.dtype:
            return None
        if not (grad.allocate_for_overwrite() or overwrite):
            return None
        return grad.data

    def finish_direct(self, packed: torch.Tensor) -> None:
        """The pre-scale of grads packed into ``direct_target`` (on the compute stream)."""
        self.scaling.prepare(packed)

    def clear(self) -> None:
        """Nothing is held between backwards."""


class TwoLevelReduceScatter:
    """HFSDP: average inside dp_shard now and accumulate; average across dp_outer (and land in
    the hybrid shard) only on the sync backward.

    The hybrid rank is ``outer_rank * inner_size + inner_rank`` (checked by
    ``two_level_groups``), so ``full`` viewed as ``[outer, inner, segment]`` and transposed to
    ``[inner, outer * segment]`` reduce-scatters into this inner rank's ``[outer, segment]``.
    """

    def __init__(self, groups: TwoLevelGroups, stream: CommStream, device: torch.device,
                 accum_dtype: torch.dtype, scaling: GradScaling = GradScaling()) -> None:
        self.groups = groups
        self.stream = stream
        self.device = device
        self.accum_dtype = accum_dtype  # the main-grads dtype
        self.scaling = scaling
        self._inner_accum: torch.Tensor | None = None  # inner-reduced, not yet synced grads

    def reduce(self, full: torch.Tensor, grad: DataParallelBuffer, sync: bool,
               overwrite: bool = False) -> torch.cuda.Event | None:
        """``overwrite`` is ignored: the synced result is always added (to zeros or not)."""
        seg = grad.layout.segment_numel
        n_in, n_out = dist.get_world_size(self.groups.inner), dist.get_world_size(self.groups.outer)
        op = self.scaling.op
        with self.stream.use():
            self.scaling.prepare(full)
            by_inner = full.view(n_out, n_in, seg).transpose(0, 1).contiguous().view(-1)
            part = by_inner[: n_out * seg] if n_in == 1 else torch.empty(n_out * seg, dtype=full.dtype,
                                                                         device=self.device)
            if n_in > 1:
                comm.reduce_scatter_op(part, by_inner, self.groups.inner, op)
            if self._inner_accum is None:
                self._inner_accum = torch.zeros(n_out * seg, dtype=self.accum_dtype, device=self.device)
            self._inner_accum.add_(part)
            if sync:
                grad.ensure_allocated()
                out = self._inner_accum.to(full.dtype)
                if n_out > 1:
                    out, acc = torch.empty(seg, dtype=full.dtype, device=self.device), out
                    comm.reduce_scatter_op(out, acc, self.groups.outer, op)
                grad.data.add_(out)
                self._inner_accum = None
        self.stream.keep_alive(full)
        return self.stream.record()

    def direct_target(self, grad: DataParallelBuffer, dtype: torch.dtype, overwrite: bool) -> torch.Tensor | None:
        """Never: the inner level accumulates across backwards (``ShardGroupReduce.direct_target``)."""
        return None

    def finish_direct(self, packed: torch.Tensor) -> None:
        raise RuntimeError("TwoLevelReduceScatter has no direct target")

    def clear(self) -> None:
        """Drop the accumulated, unsynced grads (``zero_grad``)."""
        self._inner_accum = None


UnitGradReduce = ShardGroupReduce | TwoLevelReduceScatter


def unit_grad_reduce(group: dist.ProcessGroup, all_reduce: bool, two_level: TwoLevelGroups | None,
                     stream: CommStream, device: torch.device, accum_dtype: torch.dtype,
                     scaling: GradScaling = GradScaling()) -> UnitGradReduce:
    """The reducer of one unit: two levels when HFSDP's groups nest, else one."""
    if two_level is not None:
        return TwoLevelReduceScatter(two_level, stream, device, accum_dtype, scaling)
    return ShardGroupReduce(group, all_reduce, stream, device, scaling)


class OuterGradReducer:
    """HSDP: combines every unit's main-grad shard across the dp_outer replicas, once per
    optimisation cycle (called by the engine on the sync backward, before grads are installed).

    ``groups`` holds, per unit in the engine's order, the dp_outer group its grads reduce over
    (expert units have their own) or ``None`` (no outer level for that unit); one group for
    every unit may be given as a single group."""

    def __init__(self, groups: dist.ProcessGroup | list[dist.ProcessGroup | None],
                 op: dist.ReduceOp.RedOpType = dist.ReduceOp.AVG) -> None:
        self.groups = groups
        self.op = op

    def reduce(self, grad_buffers: list[DataParallelBuffer | None]) -> None:
        """``grad_buffers``: the units' grad buffers (``None`` for frozen-only units), in the
        engine's unit order, identical on every rank."""
        groups = self.groups if isinstance(self.groups, list) else [self.groups] * len(grad_buffers)
        with comm.traced("FSDP::hsdp_outer_reduce"):
            for buf, group in zip(grad_buffers, groups, strict=True):
                if buf is None or group is None or not buf.data.numel():
                    continue
                buf.ensure_allocated()  # zero_grad(set_to_none=True) may have freed it
                comm.all_reduce_op(buf.data, group, self.op)
