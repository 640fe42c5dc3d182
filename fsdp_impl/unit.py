"""Per-unit state machine: shard at wrap time, unshard for compute, reshard, reduce grads.

A unit owns one contiguous weight buffer (its shard of every param), one contiguous grad buffer
(its shard of every trainable param's grad) and the full-size compute params. All collectives a
unit issues go through the shard group in a fixed order, so every rank issues the same sequence.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from . import comm
from .buffers import DataParallelBuffer, ParameterGroup
from .decoupled import grad_attr_name
from .device import CommStreams
from .grad_reduce import TwoLevelGroups, UnitGradReduce, unit_grad_reduce
from .param import ManagedParam
from .placement import PlacementPlan
from .policy import MixedPrecisionPolicy, ResolvedDtypes, ShardingStrategy
from .sharding import FlatLayout, shard_row_range

if TYPE_CHECKING:
    from .fp8_params import UnitFp8


@contextlib.contextmanager
def _preserve_versions(p: ManagedParam) -> Iterator[None]:
    """Writes into the compute storage must not bump the version counters autograd checks (the
    compute param's and, for a TP DTensor, its local tensor's)."""
    with torch.autograd._unsafe_preserve_version_counter(p.unsharded):
        if p.compute_local() is p.unsharded:
            yield
        else:
            with torch.autograd._unsafe_preserve_version_counter(p.compute_local()):
                yield


@dataclass
class _Gather:
    """An all-gather in flight: its output, the event that marks it done, the weights' version."""

    gathered: torch.Tensor
    event: torch.cuda.Event | None
    version: int


@dataclass
class UnitContext:
    """What every unit of one model shares: where it runs and how it shards."""

    strategy: ShardingStrategy
    shard_mesh: DeviceMesh
    group: dist.ProcessGroup
    plan: PlacementPlan  # the meshes/placements the sharded params and grads are DTensors on
    rank: int  # rank inside the shard group
    world: int  # size of the shard group
    device: torch.device
    policy: MixedPrecisionPolicy
    streams: CommStreams
    # HFSDP two-level grad reduction: reduce-scatter inside dp_shard every backward, across
    # dp_outer only on the sync backward (``None``: one reduction over ``group``).
    two_level: TwoLevelGroups | None = None
    # FP8 params: builds a unit's FP8 side once it has sharded (fp8_params.unit_fp8); None: no FP8
    fp8_setup: Callable[[FSDPUnit], UnitFp8 | None] | None = None

    @property
    def num_shards(self) -> int:
        """Shards of the weight/grad layouts: 1 for no_shard (every rank holds everything)."""
        return 1 if self.strategy == ShardingStrategy.NO_SHARD else self.world

    @property
    def layout_rank(self) -> int:
        return 0 if self.strategy == ShardingStrategy.NO_SHARD else self.rank


class FSDPUnit:
    """One FSDP unit (a ``fsdp_unit_modules`` submodule, or the root group)."""

    def __init__(self, name: str, params: list[ManagedParam], ctx: UnitContext) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            raise ValueError(f"FSDP unit {name!r} mixes parameter dtypes {sorted(map(str, dtypes))}; "
                             "cast the module to one dtype or split it into separate fsdp_unit_modules")
        self.name = name
        self.params = params
        self.ctx = ctx
        self.dtypes = ResolvedDtypes.resolve(ctx.policy, params[0].dtype if params else torch.float32)
        self.trainable = [p for p in params if p.requires_grad]
        for i, p in enumerate(self.trainable):
            p.grad_index = i
        n, r = ctx.num_shards, ctx.layout_rank
        self.weight = DataParallelBuffer(FlatLayout([p.layout_shape for p in params], n), r,
                                         self.dtypes.main_params, ctx.device)
        self.grad: DataParallelBuffer | None = None  # None: no trainable params
        if self.trainable:
            self.grad = DataParallelBuffer(FlatLayout([p.layout_shape for p in self.trainable], n), r,
                                           self.dtypes.main_grads, ctx.device)
        self.reducer: UnitGradReduce = unit_grad_reduce(
            ctx.group, ctx.strategy == ShardingStrategy.NO_SHARD, ctx.two_level, ctx.streams.reduce,
            ctx.device, self.dtypes.main_grads)
        self.group = ParameterGroup(name, self.weight, self.grad,
                                    ctx.policy.main_params_dtype is not None)
        self._accumulator: torch.Tensor | None = None  # ZeRO-0/1 full-size unsynced grads
        self._pending: torch.Tensor | None = None  # ZeRO-2/3 this backward's grads
        self._ready = 0
        self._gather: _Gather | None = None  # a prefetched all-gather not yet consumed
        self.reduce_event: torch.cuda.Event | None = None  # CUDA: marks the last grad reduction done
        self.post_backward_done = False
        self.is_unsharded = False
        self.synced_version = -1  # weight-buffer version the compute params were built from
        self._grad_cache: list[torch.Tensor | None] = [None] * len(self.trainable)
        self.fp8: UnitFp8 | None = None  # FP8 params: gathered as FP8 bytes (fp8_params.py)

    # ----------------------------------------------------------------- wrap time
    def shard_from_module(self) -> None:
        """Copy each param's local rows into the weight buffer and swap in the DTensor params."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                full = p.local_full()
                start, end = shard_row_range(p.layout_shape[0], self.ctx.num_shards, self.ctx.layout_rank)
                self.weight.local_view(i).copy_(full[start:end])
                local = self.weight.local_view(i)
                p.sharded = nn.Parameter(self.ctx.plan.wrap(local, p.tp, p.shape),
                                         requires_grad=p.requires_grad)
                p.make_unsharded(self.dtypes.compute, self.ctx.device)
                p.set_on_module(p.sharded)
        if self.ctx.fp8_setup is not None:
            self.fp8 = self.ctx.fp8_setup(self)
        if self.ctx.strategy == ShardingStrategy.OPTIM_GRADS_PARAMS:
            self._free_unsharded()

    # ------------------------------------------------------------ compute params
    def version_signature(self) -> int:
        """Sum of the version counters that move when the main weights are edited in place.

        In-place ops on a DTensor (``optimizer.step()``, ``copy_``, ``load_state_dict``) bump the
        DTensor's own counter but not its local tensor's (they run below autograd), while direct
        edits of ``_local_tensor`` or of the buffer bump only theirs; counters only grow, so the
        sum changes iff one of them did. Not seen: writes through the alias ``to_local()`` returns
        (it carries a counter of its own) — DCP loads write that way, which is why
        ``fsdp_impl.checkpoint.load`` finishes with ``model.load_state_dict``.
        """
        total = self.weight.data._version
        for p in self.params:
            total += p.sharded._version + p.sharded_local()._version
        return total

    def weights_changed(self) -> bool:
        """True when the main weights changed since the compute params were last built."""
        return self.version_signature() != self.synced_version

    def unshard(self) -> None:
        """Make the full compute params valid (ZeRO-3: allocate and all-gather, or finish a
        prefetched all-gather)."""
        if self.is_unsharded:
            return
        if self.ctx.strategy == ShardingStrategy.OPTIM_GRADS_PARAMS:
            if self._gather is None:
                self.prefetch()
            if self._gather is not None:
                self._finish_gather(self._gather)
                self._gather = None
        else:
            self.refresh()
        self.is_unsharded = True

    def prefetch(self) -> None:
        """ZeRO-3: allocate the compute storage and start the all-gather (on the gather stream
        on CUDA) so it overlaps the compute of the unit before it."""
        if (self.ctx.strategy != ShardingStrategy.OPTIM_GRADS_PARAMS or self.is_unsharded
                or self._gather is not None or not self.params):
            return
        for p in self._dense_params():
            storage = p.compute_local().untyped_storage()
            need = p.compute_local().numel() * p.compute_local().element_size()
            if storage.size() != need:
                storage.resize_(need)
        self._gather = self._start_gather()

    def refresh(self) -> None:
        """ZeRO-0/1/2: rebuild the persistent compute params from the main shards."""
        if not self.params:
            return
        if self.ctx.strategy != ShardingStrategy.NO_SHARD:
            self._finish_gather(self._start_gather())
            return
        local = self.weight.data.to(self.dtypes.compute)
        with torch.no_grad():
            for i, p in enumerate(self.params):
                with _preserve_versions(p):
                    p.compute_local().copy_(self.weight.layout.local_view(local, i, 0))
        self.synced_version = self.version_signature()

    def _start_gather(self) -> _Gather:
        """One all-gather of the unit's shards, cast to the compute dtype, on the gather stream."""
        stream = self.ctx.streams.gather
        version = self.version_signature()
        with stream.use():
            if self.fp8 is not None:  # FP8 params travel as FP8 bytes
                gathered = self.fp8.gather(self.weight, self.ctx.group)
            else:
                compute = self.dtypes.compute
                local = self.weight.data if self.weight.dtype == compute else self.weight.data.to(compute)
                gathered = torch.empty(self.weight.layout.total_numel, dtype=compute, device=self.ctx.device)
                comm.all_gather(gathered, local, self.ctx.group)
        return _Gather(gathered, stream.record(), version)

    def _finish_gather(self, gather: _Gather) -> None:
        """Wait for the gather and copy each param out of it (on the compute stream)."""
        stream = self.ctx.streams.gather
        stream.wait(gather.event)
        stream.used_by_current(gather.gathered)
        with torch.no_grad():
            gathered, layout, params = gather.gathered, self.weight.layout, self.params
            if self.fp8 is not None:  # fills the FP8 params; the others are copied out below
                gathered, layout, params = self.fp8.unpack(gather.gathered)
            for i, p in enumerate(params):
                with _preserve_versions(p):
                    layout.unpack_full(gathered, i, p.compute_local())
        self.synced_version = gather.version

    def reshard(self) -> None:
        """ZeRO-3: free the compute storage (autograd's saved references stay valid objects)."""
        if self.ctx.strategy != ShardingStrategy.OPTIM_GRADS_PARAMS:
            return
        if self._gather is not None:  # prefetched but never used
            self.ctx.streams.gather.wait(self._gather.event)
            self._gather = None
            self._free_unsharded()
        if self.is_unsharded:
            self._free_unsharded()
            self.is_unsharded = False

    def _free_unsharded(self) -> None:
        for p in self._dense_params():
            p.compute_local().untyped_storage().resize_(0)
        if self.fp8 is not None:
            self.fp8.release(after_backward=self.post_backward_done)

    def _dense_params(self) -> list[ManagedParam]:
        """Params whose compute form is one plain tensor (FP8 params have their own, in ``fp8``)."""
        return self.params if self.fp8 is None else self.fp8.other_params

    def swap_in(self) -> None:
        for p in self.params:
            p.set_on_module(p.unsharded)

    def swap_out(self) -> None:
        for p in self.params:
            p.set_on_module(p.sharded)

    # --------------------------------------------------------------------- grads
    def accept_grad(self, p: ManagedParam, comm_dtype: torch.dtype) -> bool:
        """Move ``p``'s fresh grad into the unit's reduce/accumulate buffer.

        Returns True when it was the unit's last expected grad of this backward.
        """
        grad = p.take_grad()
        if grad is None:
            return False
        layout = self._grad_buffer().layout
        if self.ctx.strategy >= ShardingStrategy.OPTIM_GRADS:
            if self._pending is None:
                self._pending = torch.zeros(layout.total_numel, dtype=comm_dtype, device=self.ctx.device)
            layout.pack_full(self._pending, p.grad_slot, grad)
        else:
            layout.pack_full(self._full_accumulator(), p.grad_slot, grad, accumulate=True)
        self._ready += 1
        return self._ready == len(self.trainable)

    def _grad_buffer(self) -> DataParallelBuffer:
        """The grad buffer, which every unit with a trainable param has."""
        if self.grad is None:
            raise RuntimeError(f"FSDP unit {self.name!r} has no trainable params, hence no grad buffer")
        return self.grad

    def _full_accumulator(self) -> torch.Tensor:
        if self._accumulator is None:
            self._accumulator = torch.zeros(self._grad_buffer().layout.total_numel,
                                            dtype=self.dtypes.main_grads, device=self.ctx.device)
        return self._accumulator

    def reduce_grads(self, sync: bool, comm_dtype: torch.dtype) -> None:
        """Once per backward: ZeRO-2/3 reduce-scatter now; ZeRO-0/1 only on the sync step."""
        if self.post_backward_done or self.grad is None:
            self.post_backward_done = True
            return
        self.post_backward_done = True
        if self.ctx.strategy >= ShardingStrategy.OPTIM_GRADS:
            full = self._pending
            if full is None:  # no grad arrived: still join the collective with zeros
                full = torch.zeros(self.grad.layout.total_numel, dtype=comm_dtype, device=self.ctx.device)
            self._pending = None
        elif sync:
            full = self._full_accumulator().to(comm_dtype)
            self._accumulator = None  # full-size: only held while a cycle accumulates
        else:
            return
        self.reduce_event = self.reducer.reduce(full, self.grad, sync)

    def end_backward(self) -> None:
        """Reset the per-backward counters; the compute stream waits for this unit's reduction."""
        self.ctx.streams.reduce.wait(self.reduce_event)
        self.reduce_event = None
        self._ready = 0
        self.post_backward_done = False

    def install_grads(self, decoupled: bool) -> None:
        """Expose the main-grad shards on the DTensor params (``.grad`` or ``.decoupled_grad``).

        Same dtype: a persistent DTensor view of the grad buffer. Different dtype (e.g. fp32 grads
        for bf16 main params): a cast copy, because torch requires ``grad.dtype == param.dtype``.
        """
        if self.grad is None:
            return
        self.grad.ensure_allocated()
        attr = grad_attr_name(decoupled)
        for p in self.trainable:
            i, sharded = p.grad_slot, p.sharded
            current = getattr(sharded, attr, None)
            if current is not None and current is self._grad_cache[i]:
                continue
            local = self.grad.local_view(i)
            if decoupled or local.dtype == sharded.dtype:
                g = self.ctx.plan.wrap(local, p.tp, p.shape)
                self._grad_cache[i] = g
            else:
                g = self.ctx.plan.wrap(local.to(sharded.dtype), p.tp, p.shape)
            setattr(sharded, attr, g)

    def zero_grad_buffers(self, free: bool = False) -> None:
        """Zero the grad buffer, or with ``free`` (``zero_grad(set_to_none=True)``) release it
        until the next reduction re-allocates it: like FSDP2 dropping sharded grads, this keeps
        grad memory out of the next forward's activation peak. ``free=False`` keeps the installed
        ``.grad`` objects as views of the same storage (needed for CUDA-graph capture)."""
        if self.grad is not None:
            if free:
                self.grad.free()
                self._grad_cache = [None] * len(self.trainable)
            elif self.grad.is_allocated:
                self.grad.data.zero_()
        self._accumulator = None
        self.reducer.clear()

    def nan_grad_flags(self) -> list[torch.Tensor]:
        """Per trainable param, a 0-dim int tensor: does this rank's grad shard hold a NaN?"""
        if not self.trainable:
            return []
        grad = self._grad_buffer()
        return [torch.isnan(grad.local_view(p.grad_slot)).any().to(torch.int32) for p in self.trainable]
