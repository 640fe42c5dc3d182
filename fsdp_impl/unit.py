"""Per-unit state machine: shard at wrap time, unshard for compute, reshard, reduce grads.

A unit owns one contiguous weight buffer (its shard of every param), one contiguous grad buffer
(its shard of every trainable param's grad) and the full-size compute params. All collectives a
unit issues go through the shard group in a fixed order, so every rank issues the same sequence.
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn as nn

from . import comm
from .buffers import DataParallelBuffer, ParameterGroup
from .copy_out import ComputeCopy
from .device import is_capturing
from .grad_reduce import UnitGradReduce, unit_grad_reduce
from .grad_staging import GradStaging
from .grad_views import GradViews
from .offload.host import UnitOffload, host_weight
from .param import ManagedParam
from .policy import ResolvedDtypes
from .sharding import FlatLayout, shard_row_range
from .unit_context import UnitContext
from .unit_gather import Gather, gather_in_compute_dtype
from .unshard_storage import (
    GatherPhase,
    PooledStorage,
    UnitStorage,
    UnshardPool,
    UnshardStorageKind,
    build_pool,
    unit_storage,
)

if TYPE_CHECKING:
    from .fp8.params import UnitFp8


class TrainingState(enum.Enum):
    """Where a unit is in the current step (FSDP2's ``TrainingState``); the engine moves it."""

    IDLE = "idle"
    FORWARD = "forward"  # between its pre- and post-forward (a recompute does not count)
    PRE_BACKWARD = "pre_backward"  # its pre-backward fired; its grads are arriving
    POST_BACKWARD = "post_backward"  # its grads of this backward are reduced (or handed on)


# One location of a param for a swap: its module's parameter dict, the name, the tensor to store.
_Swap = tuple[dict[str, nn.Parameter | None], str, nn.Parameter]
# A guard hook (hooks.py): a module's forward-pre-hook dict, the hook's key and the hook itself.
_Guard = tuple[dict[int, Callable[..., object]], int, Callable[..., object]]


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
        config = ctx.config
        dtype = params[0].dtype if params else torch.float32
        self.dtypes = ResolvedDtypes.resolve(config.mixed_precision_policy, dtype)
        self.trainable = [p for p in params if p.requires_grad]
        for i, p in enumerate(self.trainable):
            p.grad_index = i
        n, r = ctx.num_shards, ctx.layout_rank
        self.weight = DataParallelBuffer(FlatLayout([p.layout_shape for p in params], n), r,
                                         self.dtypes.main_params, ctx.device)
        if config.offload_policy is not None:  # main params in host memory (offload_policy.main_params)
            self.weight = host_weight(config.offload_policy, self.weight)
        self.grad: DataParallelBuffer | None = None  # None: no trainable params
        if self.trainable:
            self.grad = DataParallelBuffer(FlatLayout([p.layout_shape for p in self.trainable], n), r,
                                           self.dtypes.main_grads, ctx.device)
        self.reducer: UnitGradReduce = unit_grad_reduce(
            ctx.group, ctx.no_shard, ctx.two_level, ctx.streams.reduce,
            ctx.device, self.dtypes.main_grads, ctx.grad_scaling)
        self.group = ParameterGroup(name, self.weight, self.grad,
                                    ctx.config.mixed_precision_policy.main_params_dtype is not None)
        self.staging: GradStaging | None = None  # grads awaiting reduction (None: nothing trainable)
        if self.grad is not None:
            self.staging = GradStaging(self.grad.layout, self.dtypes.main_grads, ctx.device,
                                       persistent=ctx.fixed_buffers)
        self.storage: UnitStorage = unit_storage(ctx.unshard.standalone_kind(ctx.config.cuda_graph_mode), [])
        self._ready = 0
        self._gather: Gather | None = None  # a prefetched all-gather not yet consumed
        self._in_place_gather: bool | None = None  # see _gathers_in_place (decided at the first gather)
        self.reduce_event: torch.cuda.Event | None = None  # CUDA: marks the last grad reduction done
        self.state = TrainingState.IDLE
        self.is_unsharded = False  # the compute params hold valid values (ZeRO-3: gathered)
        self.synced_version = -1  # weight-buffer version the compute params were built from
        self._grad_views = GradViews(self.trainable, ctx.plan, ctx.config.cuda_graph_mode)
        self._copy_out = ComputeCopy()  # gathered values -> compute params, targets kept
        # (module param dict, name, tensor) per param location for swap_in / swap_out, built at
        # the first swap after sharding: a swap is then one dict store per location
        self._swaps: tuple[list[_Swap], list[_Swap]] | None = None
        # hooks refusing a call of a module holding this unit's params while they are sharded
        # (hooks.py): present exactly while swapped out, so a forward runs them hook-free
        self.guards: list[_Guard] = []
        self._solo_gather = comm.solo(ctx.gather_group or ctx.group)  # one rank: no gather (_start_gather)
        self.fp8: UnitFp8 | None = None  # FP8 params: gathered as FP8 bytes (fp8/params.py)
        self.offload = (UnitOffload(config.offload_policy, ctx.device, self.weight, self.grad, self.dtypes.compute,
                                    self.version_signature) if config.offload_policy is not None else None)

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
        kind = self.ctx.unshard.standalone_kind(self.ctx.config.cuda_graph_mode)
        self.storage = unit_storage(kind, self.compute_tensors())
        if self.ctx.zero3:
            self._release_unsharded()

    def compute_tensors(self) -> list[torch.Tensor]:
        """The plain tensors holding the compute values (what the unshard storage manages;
        FP8 params keep their own bytes, in ``fp8``)."""
        params = self.params if self.fp8 is None else self.fp8.other_params
        return [p.compute_local() for p in params]

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

    @property
    def tracks_versions(self) -> bool:
        """Whether anything reads ``synced_version``: the ZeRO-0/1/2 refresh decision and FP8
        requantisation; plain ZeRO-3 re-gathers on every unshard, so it skips the signature."""
        return not self.ctx.zero3 or self.fp8 is not None

    def weights_changed(self) -> bool:
        """True when the main weights changed since the compute params were last built."""
        return self.version_signature() != self.synced_version

    def unshard(self, phase: GatherPhase = GatherPhase.FORWARD) -> None:
        """Make the full compute params valid (ZeRO-3: allocate and all-gather, or finish a
        prefetched all-gather; ``phase``: forward, pre-backward or an activation recompute)."""
        if self.is_unsharded:
            return
        if self.ctx.zero3:
            if self._gather is None:
                self.prefetch()
            if self._gather is not None:
                self.storage.on_unshard(self, phase)
                self._finish_gather(self._gather)
                self._gather = None
        else:
            self.refresh()
        self.is_unsharded = True

    def holds_through_backward(self) -> bool:
        """Whether the unit keeps its compute params from its forward to its backward instead of
        resharding after the forward: one rank, FP8 params whose byte planes alias the shard and
        whose transposes are kept (``keep_fp8_transpose_cache``), storage of its own (not pooled),
        nothing offloaded. A reshard would then free only the other params' compute copies
        (norms, biases: a few KiB per block) and the backward would copy them out again, per unit
        the host work of a gather and an unpack that the FP8 step, bound by the host, waits for."""
        fp8 = self.fp8
        return (fp8 is not None and fp8.aliased and fp8.keep_transpose and self._solo_gather
                and self.offload is None and not isinstance(self.storage, PooledStorage))

    def evict(self) -> None:
        """An unshard-storage pool gave this unit's slot to another unit (see unshard_storage)."""
        self.is_unsharded = False

    def prefetch(self) -> None:
        """ZeRO-3: allocate the compute storage and start the all-gather (on the gather stream
        on CUDA) so it overlaps the compute of the unit before it."""
        if not self.ctx.zero3 or self.is_unsharded or self._gather is not None or not self.params:
            return
        self.storage.on_gather_start()
        self._gather = self._start_gather()

    def refresh(self) -> None:
        """ZeRO-0/1/2: rebuild the persistent compute params from the main shards (finishing the
        gather ``prefetch_refresh`` started, if any)."""
        if not self.params:
            return
        if not self.ctx.no_shard:
            gather, self._gather = self._gather, None
            self._finish_gather(gather if gather is not None else self._start_gather())
            return
        local = self._gather_input().to(self.dtypes.compute)
        self._copy_out(local, self.weight.layout, self.params, fused=not self.ctx.config.cuda_graph_mode)
        self.synced_version = self.version_signature()

    def regather_fp8_rowwise(self) -> None:
        """An activation recompute inside the backward needs the FP8 weights' row-wise bytes,
        which the backward gather skipped under ``keep_fp8_transpose_cache``: gather them now
        (one more all-gather of the unit; every rank recomputes the same units)."""
        if self.fp8 is None or self.fp8.rowwise_ready():
            return
        with comm.traced("FSDP::recompute_fp8_gather"):
            self._finish_gather(self._start_gather(force_fp8=True))

    def _start_gather(self, force_fp8: bool = False) -> Gather:
        """One all-gather of the unit's shards, cast to the compute dtype, on the gather stream."""
        stream = self.ctx.streams.gather
        version = self.version_signature() if self.tracks_versions else self.synced_version
        if self._solo_gather and self.offload is None:
            # one rank: the shard is the whole unit, so the copy-out reads (and casts) straight
            # from it on the compute stream: no gathered copy, side-stream switch or event (FP8:
            # the unit's own segment, its other params copied in on the compute stream too)
            if self.fp8 is None:
                return Gather(self.weight.data, None, version)
            return Gather(self.fp8.solo(force_fp8), None, version, direct=True)
        with stream.use(), self.ctx.comm_allocation():
            if self.fp8 is not None:  # FP8 params travel as FP8 bytes
                gathered = self.fp8.gather(self.weight, self.ctx.gather_group or self.ctx.group, force_fp8)
            else:
                gathered = self._gather_compute_dtype()
        return Gather(gathered, stream.record(), version)

    def _gather_compute_dtype(self) -> torch.Tensor:
        """All-gather the weight shards in the compute dtype. A shard that needs a cast is cast
        straight into this rank's chunk of the output and gathered in place (FSDP2 does the same):
        no separate low-precision copy of the shard is allocated, and the collective has no
        input segment of its own to copy."""
        group = self.ctx.gather_group or self.ctx.group
        source = self._gather_input()
        in_place = source.dtype != self.dtypes.compute and self._gathers_in_place(group)
        return gather_in_compute_dtype(source, self.weight.layout, self.dtypes.compute, group, in_place)

    def _gather_input(self) -> torch.Tensor:
        """This rank's shard on the device, where a gather starts: the weight buffer, or with CPU
        offload its device copy (``UnitOffload.gather_source``)."""
        return self.weight.data if self.offload is None else self.offload.gather_source()

    def _gathers_in_place(self, group: dist.ProcessGroup) -> bool:
        """Whether this rank's chunk of the gather output is its own layout segment (the gather
        group has one member per shard and ranks them as the layout does)."""
        if self._in_place_gather is None:
            self._in_place_gather = (group.size() == self.weight.layout.num_shards
                                     and group.rank() == self.ctx.layout_rank)
        return self._in_place_gather

    def _finish_gather(self, gather: Gather) -> None:
        """Wait for the gather and copy each param out of it (on the compute stream)."""
        stream = self.ctx.streams.gather
        if gather.event is not None:  # made on the gather stream (else on this one: nothing to order)
            stream.wait(gather.event)
            stream.used_by_current(gather.gathered)
        with torch.no_grad():
            gathered, layout, params = gather.gathered, self.weight.layout, self.params
            if self.fp8 is not None and gather.direct:
                # one rank: FP8 bytes in place, the others straight from their main shards
                self.fp8.fill(gather.gathered)
                if self.fp8.other_params:
                    self._copy_out.from_shards(self.weight, self.fp8.other_index, self.fp8.other_params)
                params = []
            elif self.fp8 is not None:  # fills the FP8 params; the others are copied out below
                gathered, layout, params = self.fp8.unpack(gather.gathered)
            if params:
                self._copy_out(gathered, layout, params, fused=not self.ctx.config.cuda_graph_mode)
        self.synced_version = gather.version

    def prefetch_refresh(self) -> None:
        """ZeRO-1/2: start the all-gather the next ``refresh`` finishes, so it overlaps the
        compute of the unit before it (the main weights do not change inside a forward)."""
        if not self.ctx.refreshes or self._gather is not None or not self.params:
            return
        self._gather = self._start_gather()

    def drop_prefetched_refresh(self) -> None:
        """ZeRO-1/2: forget a prefetched gather the last forward did not use (it skipped this
        unit); its values may predate the optimizer step since."""
        if not self.ctx.zero3:
            self._discard_gather()

    def _discard_gather(self) -> bool:
        """Forget a started gather nobody will finish (the gather stream waits for it so its
        buffer is not reused early); True when there was one."""
        if self._gather is None:
            return False
        self.ctx.streams.gather.wait(self._gather.event)
        self._gather = None
        return True

    def reshard(self) -> None:
        """ZeRO-3: free the compute storage (autograd's saved references stay valid objects)."""
        if not self.ctx.zero3:
            return
        if self._discard_gather():  # prefetched but never used
            self._release_unsharded()
        if self.is_unsharded:
            self._release_unsharded()
            self.is_unsharded = False

    def _release_unsharded(self) -> None:
        """Give the compute storage back (how: the unshard storage) and the FP8 bytes."""
        self.storage.on_reshard(self)
        if self.fp8 is not None:
            self.fp8.release(after_backward=self.state == TrainingState.POST_BACKWARD)

    def swap_in(self) -> None:
        """Register the compute params on their modules (unit forward / backward), lift the guards."""
        for params, name, tensor in self._swap_lists()[0]:
            params[name] = tensor
        for hooks, key, _ in self.guards:
            hooks.pop(key, None)

    def _swap_lists(self) -> tuple[list[_Swap], list[_Swap]]:
        """Per location of every param (tied weights: several) the module's parameter dict, the
        name and the compute / sharded param: what ``ManagedParam.set_on_module`` stores, flattened
        once (both forms exist from the wrap on and are never replaced)."""
        if self._swaps is None:
            locations = [(module._parameters, name, p) for p in self.params for module, name in p.locations]
            self._swaps = ([(d, name, p.unsharded) for d, name, p in locations],
                           [(d, name, p.sharded) for d, name, p in locations])
        return self._swaps

    def param_modules(self) -> list[nn.Module]:
        """The modules that hold this unit's params (each once, in param order)."""
        seen: dict[int, nn.Module] = {}
        for p in self.params:
            for module, _ in p.locations:
                seen.setdefault(id(module), module)
        return list(seen.values())

    def hooked_submodules(self) -> list[nn.Module]:
        """Modules whose own pre-forward must reach the engine: every module holding the unit's
        params with ``enable_fine_grained_param_gather``; else, under ZeRO-3 with
        ``keep_fp8_transpose_cache``, the FP8 modules (a recompute of one needs its row-wise
        bytes back, ``regather_fp8_rowwise``)."""
        if self.ctx.config.enable_fine_grained_param_gather:
            return self.param_modules()
        # (planes aliasing the shard are never released: the row-wise bytes are always there)
        if self.fp8 is not None and self.fp8.keep_transpose and self.ctx.zero3 and not self.fp8.aliased:
            return self.fp8.modules()
        return []

    def swap_out(self) -> None:
        """Register the sharded DTensor params again (outside the unit's compute), and the guards."""
        for params, name, tensor in self._swap_lists()[1]:
            params[name] = tensor
        for hooks, key, hook in self.guards:
            hooks[key] = hook

    # --------------------------------------------------------------------- grads
    def accept_grad(self, p: ManagedParam) -> bool:
        """Hand ``p``'s fresh grad to the unit's staging (ZeRO-2/3) or accumulator (ZeRO-0/1).

        Returns True when it was the unit's last expected grad of this backward.
        """
        grad = p.take_grad()
        if grad is None:
            return False
        staging = self._staging()
        if self.ctx.shards_grads:
            staging.stash(p.grad_slot, grad)  # packed in one op when the unit reduces
        else:
            self._grad_buffer().layout.pack_full(staging.accumulator(), p.grad_slot, grad, accumulate=True)
        self._ready += 1
        return self._ready == len(self.trainable)

    def _grad_buffer(self) -> DataParallelBuffer:
        """The grad buffer, which every unit with a trainable param has."""
        if self.grad is None:
            raise RuntimeError(f"FSDP unit {self.name!r} has no trainable params, hence no grad buffer")
        return self.grad

    def _staging(self) -> GradStaging:
        if self.staging is None:
            raise RuntimeError(f"FSDP unit {self.name!r} has no trainable params, hence no grad staging")
        return self.staging

    def reduce_grads(self, sync: bool, comm_dtype: torch.dtype) -> None:
        """Once per backward: ZeRO-2/3 reduce-scatter now; ZeRO-0/1 only on the sync step."""
        done, self.state = self.state == TrainingState.POST_BACKWARD, TrainingState.POST_BACKWARD
        if done or self.grad is None:
            return
        overwrite = False
        with self.ctx.comm_allocation():
            if self.ctx.shards_grads:
                overwrite = self.grad.take_zeroed(self._capture_token())
                direct = self.reducer.direct_target(self.grad, comm_dtype, overwrite)
                full = self._staging().take_pending(comm_dtype, out=direct)  # zeros if no grad arrived
                if direct is not None:  # one rank: packed straight into the grad buffer
                    self.reducer.finish_direct(direct)
                    self.reduce_event = None
                    return
            elif sync:
                full = self._staging().take_accumulated(comm_dtype)
            else:
                return
        if not self.ctx.shards_grads:
            overwrite = self.grad.take_zeroed(self._capture_token())
        self.reduce_event = self.reducer.reduce(full, self.grad, sync, overwrite)

    def _capture_token(self) -> object | None:
        """Which zeroing a reduction may rely on (``DataParallelBuffer.take_zeroed``): None
        eagerly; inside ``capture_train_step``'s capture its token; inside any other capture a
        new object, which matches nothing (that graph always adds)."""
        if not is_capturing(self.ctx.device):
            return None
        return self.ctx.capture_token if self.ctx.capture_token is not None else object()

    def end_backward(self) -> None:
        """Reset the per-backward counters; the compute stream waits for this unit's reduction."""
        self.ctx.streams.reduce.wait(self.reduce_event)
        self.reduce_event = None
        if self.staging is not None:
            self.staging.end_backward()
        self._ready = 0
        self.state = TrainingState.IDLE

    def grads_to_host(self) -> None:
        """Offloaded grads: start the reduced grads' copy into the host buffer (asynchronous with
        pinned memory; ``install_grads`` may read them only after the engine waited for it)."""
        if self.grad is not None and self.offload is not None and self.offload.host_grad is not None:
            self.offload.grads_to_host(self.grad)

    def install_grads(self, decoupled: bool) -> None:
        """Expose the main-grad shards on the DTensor params (``.grad`` or ``.decoupled_grad``;
        how: ``grad_views.GradViews``), from the host buffer when grads are offloaded."""
        if self.grad is None:
            return
        if self.offload is not None and self.offload.host_grad is not None:
            buffer = self.offload.host_grad  # filled by grads_to_host; the engine waited for the copies
        else:
            buffer = self.grad
            buffer.ensure_allocated()
        self._grad_views.install(buffer, decoupled)

    def zero_grad_buffers(self, free: bool = False) -> None:
        """Zero the grad buffer, or with ``free`` (``zero_grad(set_to_none=True)``) release it
        until the next reduction re-allocates it: like FSDP2 dropping sharded grads, this keeps
        grad memory out of the next forward's activation peak (the cached grad views stay valid
        objects; the optimizer sets the user-visible ``.grad`` to None). ``free=False`` keeps the
        installed ``.grad`` objects as views of the same storage (needed for CUDA-graph capture).
        Cast copies are only cached under CUDA-graph mode, which refuses ``free``."""
        if self.grad is not None:
            if free and self.ctx.user_buffers is None:  # a registered buffer stays (zeroed below)
                self.grad.free()
            elif self.grad.is_allocated:
                self.grad.zero(self._capture_token())
        if self.offload is not None:
            self.offload.zero_host_grads(free)
        if self.staging is not None:
            self.staging.clear()
        self.reducer.clear()

    def nan_grad_flags(self) -> list[torch.Tensor]:
        """Per trainable param, a 0-dim int tensor: does this rank's grad shard hold a NaN?"""
        if not self.trainable:
            return []
        grad = self._grad_buffer()
        return [torch.isnan(grad.local_view(p.grad_slot)).any().to(torch.int32) for p in self.trainable]


def attach_unshard_pool(units: list[FSDPUnit], ctx: UnitContext) -> UnshardPool | None:
    """ZeRO-3 with the POOL unshard storage: make the compute params of ``units`` (the non-root
    units, engine order) views into a shared pool; otherwise leave every unit's own storage."""
    if ctx.unshard.kind != UnshardStorageKind.POOL or not ctx.zero3:
        return None
    pooled = [u for u in units if u.params]
    if not pooled:
        return None
    pool, storages = build_pool([u.compute_tensors() for u in pooled], ctx.unshard.slots, ctx.device)
    for unit, storage in zip(pooled, storages, strict=True):
        unit.storage = storage
        unit._copy_out.forget()  # its compute tensors now view the pool
    return pool
