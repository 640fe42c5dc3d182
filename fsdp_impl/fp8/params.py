"""FP8 parameters under the FSDP engine: sharded quantisation, FP8-byte gathers, the compute slots.

An FP8 parameter (the weight of a ``Float8Linear`` built with ``fp8_params=True``, or a
TransformerEngine weight built under ``te.quantized_model_init``) keeps its high-precision value
only as the unit's fp32 main shard; its compute form is FP8 bytes (1 per element) plus scales
that every rank derives identically. That is what the unit all-gathers instead of the
compute-dtype copy (design: ``fsdp_impl/fp8/README.md``):

* ``requantize`` (root pre-forward, for the units whose main weights changed, i.e. once per
  optimisation step): each rank casts its main rows to the compute dtype, takes their partial
  amaxes, one MAX all-reduce over the shard group makes them the full tensors' amaxes (not needed
  for delayed scaling, whose scale is known before the cast), and each rank casts its rows into
  the unit's persistent local FP8 segment. The bytes equal quantising the full compute weight.
* gather: the unit's segment is ``[FP8 bytes | other params in the compute dtype]`` as uint8
  (equal size on every rank), one all-gather; the FP8 params' byte planes are filled, the other
  params unpacked as usual. With ``keep_fp8_transpose_cache=True`` the forward's transposed
  copies stay until the unit's backward, whose gather then moves only the other params.
* ``after_sync_backward``: the pending amaxes of every delayed-scaling quantizer (inputs, weights,
  grads) of the model, one MAX all-reduce over the data-parallel group, then every history
  advances: all ranks hold the same scales (a checkpoint of them resumes exactly).

Deviation from "FP8 parameters need ZeRO-3": ZeRO-1/2 work too (the FP8 compute weights are
persistent and refreshed by the same FP8-byte gather whenever the main weights changed), because
seed-compatible callers run TE FP8 parameters with ZeRO-1/2; only no_shard is refused (nothing is
gathered there, every rank would keep the full weight anyway).
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .. import comm
from ..buffers import DataParallelBuffer
from ..param import ManagedParam
from ..policy import MixedPrecisionPolicy, ShardingStrategy
from ..sharding import FlatLayout, shard_row_range
from .linear import Float8Linear
from .quantizer import DelayedQuantizer
from .sharded import ShardedQuantization, ShardedWeight
from .state import advance_all, delayed_quantizers, pack_pending, set_deferred
from .te import (
    TeFp8Param,
    TeQuantize,
    fill_te,
    free_storage,
    is_te_quantized,
    module_has_te_fp8_params,
)
from .tensor import Fp8Tensor

_ALIGN = 16  # byte alignment of the two parts of a gather segment
# Byte planes that alias the FP8 segment (one shard) must start this many bytes apart from its
# start (which the CUDA caching allocator aligns to 512), so GEMM and transpose kernels see the
# alignment standalone planes would have.
_PLANE_ALIGN = 256
MAIN_DTYPES = (torch.float32, torch.float64)


class Fp8Param(Protocol):
    """One FP8 parameter of a unit: a 2-D weight sharded by rows like any param, whose compute
    form is ``planes()`` (full-size ``(rows, cols)`` uint8 tensors) plus replicated scales."""

    kind: str  # params of one kind are quantised in one call (one MAX all-reduce)
    managed: ManagedParam
    index: int  # position in the unit's params (its main shard's view in the weight buffer)
    shape: tuple[int, int]

    def planes(self) -> list[torch.Tensor]: ...

    def alias(self, planes: list[torch.Tensor]) -> None:
        """Make ``planes`` (views of the unit's FP8 segment) the param's byte planes for good:
        ``release`` then frees nothing but what ``filled`` built (one shard: ``UnitFp8``)."""

    def filled(self, keep_transpose: bool) -> None: ...

    def release(self, keep_transpose: bool) -> None: ...

    def has_transpose(self) -> bool: ...

    def has_rowwise(self) -> bool: ...


class NativeFp8Param:
    """The weight of a torch-native ``Float8Linear``: its bytes land in ``fp8_weight_slot``."""

    kind = "native"

    def __init__(self, managed: ManagedParam, index: int, module: Float8Linear, device: torch.device) -> None:
        self.managed, self.index, self.module = managed, index, module
        self.shape = (module.out_features, module.in_features)
        self.data = torch.empty(self.shape, dtype=torch.uint8, device=device)
        free_storage(self.data)
        self.scale_inv: torch.Tensor | None = None  # the full tensor's grid, same on every rank
        self.block = self.shape
        # the plane as the FP8 dtype, built once: a view reads its storage's address at use, so it
        # stays valid while ``data`` is freed and re-allocated (``untyped_storage().resize_``)
        self._fp8_data = self.data.view(module.fp8_quantizers.weight.dtype)
        self.aliased = False

    def planes(self) -> list[torch.Tensor]:
        return [self.data]

    def alias(self, planes: list[torch.Tensor]) -> None:
        (self.data,) = planes
        self._fp8_data = self.data.view(self.module.fp8_quantizers.weight.dtype)
        self.aliased = True

    def filled(self, keep_transpose: bool) -> None:
        if self.scale_inv is None:
            raise RuntimeError(f"FP8 parameter {self.managed.fqn!r} was gathered before it was quantised")
        slot = self.module.fp8_weight_slot
        slot.keep_transpose = keep_transpose
        dtype = self.module.fp8_quantizers.weight.dtype
        if self._fp8_data.dtype != dtype:  # a recipe swapped since (not done today): view again
            self._fp8_data = self.data.view(dtype)
        slot.fill(Fp8Tensor(self._fp8_data, self.scale_inv, self.block))

    def release(self, keep_transpose: bool) -> None:
        self.module.fp8_weight_slot.release(keep_transpose)
        if not self.aliased:
            free_storage(self.data)

    def has_transpose(self) -> bool:
        return self.module.fp8_weight_slot.has_transpose

    def has_rowwise(self) -> bool:
        """The slot derives the row-wise weight from a kept transpose exactly (``rowwise()``)."""
        return self.module.fp8_weight_slot.rowwise() is not None


@dataclass
class QuantizeItem:
    """One FP8 param's share of a requantisation on this rank."""

    param: Any  # an Fp8Param
    shard: torch.Tensor  # this rank's rows of the main weight (2-D, main dtype; maybe empty)
    row_start: int
    out: list[torch.Tensor]  # per byte plane: this rank's rows in the local FP8 segment
    compute: torch.dtype  # what the main rows are cast to before quantising


def quantize_native(items: list[QuantizeItem], group: dist.ProcessGroup) -> None:
    """``fsdp_impl.fp8.sharded``: partial amaxes, one MAX all-reduce (skipped when every weight
    uses delayed scaling: its scale is known, the amaxes are reduced after the backward), casts."""
    weights = [ShardedWeight(it.param.module.fp8_quantizers.weight, it.shard.to(it.compute), it.param.shape,
                             it.row_start) for it in items]
    plan = ShardedQuantization(weights)
    amax = plan.amax_buffer()
    if not all(isinstance(w.quantizer, DelayedQuantizer) for w in weights):
        comm.all_reduce_max(amax, group)
    for it, quantized in zip(items, plan.finish(amax), strict=True):
        it.out[0].copy_(quantized.data.view(torch.uint8))
        it.param.scale_inv, it.param.block = quantized.scale_inv, quantized.block


# Per kind: the requantisation of a fixed list of items, built once, then called with the group
# every step (``ModelFp8.requantize`` keeps them): TE's keeps its per-weight objects.
_Plan = Callable[[dist.ProcessGroup], None]
PLAN: dict[str, Callable[[list[QuantizeItem]], _Plan]] = {
    NativeFp8Param.kind: lambda items: functools.partial(quantize_native, items),
    TeFp8Param.kind: TeQuantize,
}


def _fill_each(params: list[Any], keep_transpose: bool) -> None:
    for f in params:
        f.filled(keep_transpose)


# Per kind: new bytes landed in a unit's params of that kind (TE: one post-gather call per unit).
FILL: dict[str, Callable[[list[Any], bool], None]] = {
    NativeFp8Param.kind: _fill_each,
    TeFp8Param.kind: fill_te,
}


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


class UnitFp8:
    """The FP8 side of one unit: byte layout, persistent local FP8 shard, gather and unpack."""

    def __init__(self, params: list[ManagedParam], fp8: list[Any], num_shards: int, rank: int,
                 compute: torch.dtype, device: torch.device, keep_transpose: bool,
                 graph_mode: bool = False) -> None:
        owned = [f.managed for f in fp8]
        self.fp8_params = fp8
        self.other_index = [i for i, p in enumerate(params) if all(p is not o for o in owned)]
        self.other_params = [params[i] for i in self.other_index]
        self.n, self.rank, self.compute, self.device = num_shards, rank, compute, device
        self.keep_transpose = keep_transpose
        self.graph_mode = graph_mode  # capture-safe copies (``FlatLayout.unpack_all(fused=False)``)
        self._by_kind: dict[str, list[Any]] = {}
        for f in fp8:
            self._by_kind.setdefault(f.kind, []).append(f)
        self._plane_slots: list[list[int]] = []
        shapes: list[tuple[int, int]] = []
        for f in fp8:
            self._plane_slots.append(list(range(len(shapes), len(shapes) + len(f.planes()))))
            shapes += [f.shape] * len(f.planes())
        self.fp8_layout = FlatLayout(shapes, num_shards)
        self.other_layout = FlatLayout([p.layout_shape for p in self.other_params], num_shards)
        self.fp8_bytes = _round_up(self.fp8_layout.segment_numel, _ALIGN)
        self.other_nbytes = self.other_layout.segment_numel * torch.empty(0, dtype=compute).element_size()
        self.other_bytes = _round_up(self.other_nbytes, _ALIGN)
        # This rank's gather segment, kept for the model's lifetime: the requantisation writes the
        # FP8 bytes straight into its head (``fp8_local``), so a gather only copies the other
        # params in behind them (no per-gather zero-fill and copy of the FP8 bytes).
        self._send = torch.zeros(self.fp8_bytes + self.other_bytes, dtype=torch.uint8, device=device)
        self.fp8_local = self._send[: self.fp8_layout.segment_numel]
        self._with_fp8 = True  # does the gather in flight (a unit has at most one) carry FP8 bytes?
        # Every byte plane in slot order (the planes are persistent tensors, refilled and freed),
        # its size in bytes, and where ``unpack_all`` writes it (views stay valid across the resizes).
        self._planes = [data for f in fp8 for data in f.planes()]
        self._plane_nbytes = [data.numel() * data.element_size() for data in self._planes]
        self._plane_plan = self.fp8_layout.unpack_plan(self._planes)
        # One shard: the requantisation already writes every plane's bytes into ``fp8_local``, so
        # the planes become views of it for good (no per-gather resize, copy or free), where each
        # starts at an aligned address; otherwise they are copied out like any gather.
        self.aliased = num_shards == 1 and self._alias_planes()
        # This rank's part of a gather, with and without the FP8 bytes (fixed slices of ``_send``);
        # with one shard that part is the whole gather (``gather``), and ``unpack`` reads it through
        # views built once per form: (FP8 rows or None, the other params as ``[1, numel]`` compute dtype).
        self._local = {True: self._send, False: self._send[self.fp8_bytes:]}
        self._solo_views: dict[bool, tuple[torch.Tensor | None, torch.Tensor]] = {}
        # Built on first use for the weight buffer they view (rebuilt if that tensor is replaced).
        self._items: tuple[torch.Tensor, list[QuantizeItem]] | None = None
        self._copies: tuple[torch.Tensor, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] | None = None

    def _alias_planes(self) -> bool:
        views = [self.fp8_layout.local_view(self.fp8_local, s, 0) for slots in self._plane_slots for s in slots]
        base = self.fp8_local.data_ptr()  # the device allocator aligns it (CUDA: 512 bytes)
        if any((v.data_ptr() - base) % _PLANE_ALIGN for v in views if v.numel()):
            return False
        for f, slots in zip(self.fp8_params, self._plane_slots, strict=True):
            f.alias([views[s] for s in slots])
        self._planes = views
        return True

    def quantize_items(self, weight: DataParallelBuffer) -> list[QuantizeItem]:
        """This unit's share of a requantisation: the same list (views of ``weight``'s data and of
        the persistent FP8 segment) every step, so the requantisation can keep per-item state."""
        if self._items is not None and self._items[0] is weight.data:
            return self._items[1]
        items = []
        for f, slots in zip(self.fp8_params, self._plane_slots, strict=True):
            start, _ = shard_row_range(f.shape[0], self.n, self.rank)
            out = [self.fp8_layout.local_view(self.fp8_local, s, self.rank) for s in slots]
            items.append(QuantizeItem(f, weight.local_view(f.index), start, out, self.compute))
        self._items = (weight.data, items)
        return items

    def _other_copies(self, weight: DataParallelBuffer) -> list[tuple[list[torch.Tensor], list[torch.Tensor]]]:
        """(destinations, sources) per dtype pair: the other params' main shards into their place
        behind the FP8 bytes of the send segment (one ``_foreach_copy_`` each)."""
        if self._copies is not None and self._copies[0] is weight.data:
            return self._copies[1]
        others = self._send[self.fp8_bytes: self.fp8_bytes + self.other_nbytes].view(self.compute)
        groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for j, i in enumerate(self.other_index):
            dst, src = self.other_layout.local_view(others, j, self.rank), weight.local_view(i)
            if dst.numel():
                pair = groups.setdefault((dst.dtype, src.dtype), ([], []))
                pair[0].append(dst)
                pair[1].append(src)
        self._copies = (weight.data, list(groups.values()))
        return self._copies[1]

    def _gathers_fp8(self) -> bool:
        """False only in a backward whose forward kept every FP8 param's transposed copy.
        Every rank runs the same control flow, so all ranks decide alike."""
        in_backward = torch._C._current_graph_task_id() != -1
        return not (in_backward and self.keep_transpose and all(f.has_transpose() for f in self.fp8_params))

    def rowwise_ready(self) -> bool:
        """Whether every FP8 param can run a forward GEMM now: false after a backward gather that
        skipped the FP8 bytes (``keep_fp8_transpose_cache``), which an activation recompute in
        that backward needs (``FSDPUnit.regather_fp8_rowwise``)."""
        return all(f.has_rowwise() for f in self.fp8_params)

    def modules(self) -> list[nn.Module]:
        """The modules holding this unit's FP8 params (each once)."""
        seen: dict[int, nn.Module] = {}
        for f in self.fp8_params:
            module = f.managed.locations[0][0]
            seen.setdefault(id(module), module)
        return list(seen.values())

    def gather(self, weight: DataParallelBuffer, group: dist.ProcessGroup, force_fp8: bool = False) -> torch.Tensor:
        """All-gather ``[FP8 bytes | other params]`` (uint8, ``[n * segment]``) of the unit
        (``force_fp8``: the FP8 bytes too where ``_gathers_fp8`` would leave them out).

        One rank: the gather would only copy this rank's segment, so the segment itself (a slice
        of the persistent ``_send``) is returned and ``unpack`` reads it in place. Nothing writes
        ``_send`` between a gather and its unpack: a unit has one gather in flight at a time, and
        the requantisation (which writes the FP8 bytes) runs at the root's pre-forward, after every
        unused prefetched gather was dropped. On CUDA the later writers come after the unpack's
        reads in stream order: the requantisation on the compute stream, the next gather's copies
        on the gather stream once it waited for the compute stream (``CommStream.use``)."""
        self._with_fp8 = with_fp8 = force_fp8 or self._gathers_fp8()
        local = self._local[with_fp8]  # [FP8 bytes |] other params
        for dsts, srcs in self._other_copies(weight):
            torch._foreach_copy_(dsts, srcs)
        if self.n == 1 and comm.solo(group):
            return local
        gathered = torch.empty(local.numel() * self.n, dtype=torch.uint8, device=self.device)
        if local.numel():
            comm.all_gather(gathered, local, group)
        return gathered

    def solo(self, force_fp8: bool = False) -> torch.Tensor:
        """One rank, the other params copied by the unit from their main shards (``fill`` reads
        only the FP8 bytes): the unit's own segment, nothing copied into it."""
        self._with_fp8 = with_fp8 = force_fp8 or self._gathers_fp8()
        return self._local[with_fp8]

    def _views(self, gathered: torch.Tensor, with_fp8: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``gathered`` as (the FP8 planes' ``[n, fp8 segment]`` uint8 columns, or None without
        them; the other params' ``[n, other segment]`` in the compute dtype), strided views (no
        copy); built once for the one-rank gathers, which are always the same two tensors."""
        solo = gathered is self._local[with_fp8]
        if solo and with_fp8 in self._solo_views:
            return self._solo_views[with_fp8]
        fp8_bytes = self.fp8_bytes if with_fp8 else 0
        rows = gathered.view(self.n, fp8_bytes + self.other_bytes)
        fp8_rows = rows.narrow(1, 0, self.fp8_layout.segment_numel) if with_fp8 else None
        views = (fp8_rows, rows.narrow(1, fp8_bytes, self.other_nbytes).view(self.compute))
        if solo:
            self._solo_views[with_fp8] = views
        return views

    def unpack(self, gathered: torch.Tensor) -> tuple[torch.Tensor, FlatLayout, list[ManagedParam]]:
        """Fill the FP8 params from a gather; return the other params' gathered values (compute
        dtype, ``[n, segment]`` of ``other_layout``, maybe strided) for the unit to copy out."""
        self.fill(gathered)
        return self._views(gathered, self._with_fp8)[1], self.other_layout, self.other_params

    def fill(self, gathered: torch.Tensor) -> None:
        """Fill the FP8 params from a gather (or, one rank, from the unit's own segment, whose
        other params ``gather`` left out: the unit copies those from their main shards)."""
        fp8_rows, _ = self._views(gathered, self._with_fp8)
        if fp8_rows is not None:
            if not self.aliased:  # (aliased planes already hold the bytes: they are ``fp8_rows``)
                for data, nbytes in zip(self._planes, self._plane_nbytes, strict=True):
                    storage = data.untyped_storage()
                    if storage.size() != nbytes:
                        storage.resize_(nbytes)
                # every plane in one call (one kernel where the layout allows: ``unpack_all``)
                self.fp8_layout.unpack_all(fp8_rows, self._planes, fused=not self.graph_mode,
                                           plan=self._plane_plan)
            for kind, params in self._by_kind.items():  # looked up per call: bench.host_profile times FILL
                FILL[kind](params, self.keep_transpose)

    def release(self, after_backward: bool) -> None:
        """The unit resharded: free the FP8 bytes (the forward's transposes stay for the
        backward with ``keep_fp8_transpose_cache``)."""
        keep = self.keep_transpose and not after_backward
        for f in self.fp8_params:
            f.release(keep)


class ModelFp8:
    """What the engine drives once per step: requantisation and the delayed-scaling reduction."""

    def __init__(self, group: dist.ProcessGroup, amax_group: dist.ProcessGroup,
                 delayed: list[DelayedQuantizer]) -> None:
        self.group = group  # shard group: the weights' partial amaxes
        self.amax_group = amax_group  # all data-parallel ranks: activations' and grads' amaxes
        self.delayed = delayed
        # per set of units (by their item lists, kept alive here so their ids stay theirs): the
        # requantisation plans, one per kind; ZeRO-3 requantises every unit each step (one entry)
        self._plans: dict[tuple[int, ...], tuple[list[list[QuantizeItem]], list[_Plan]]] = {}

    def requantize(self, units: Sequence[Any]) -> None:
        """Quantise the FP8 params of ``units`` (the units whose main weights changed; engine
        unit order, identical on every rank) from their main shards."""
        lists = [unit.fp8.quantize_items(unit.weight) for unit in units if unit.fp8 is not None]
        if not lists:
            return
        key = tuple(map(id, lists))
        cached = self._plans.get(key)
        if cached is None:
            by_kind: dict[str, list[QuantizeItem]] = {}
            for items in lists:
                for item in items:
                    by_kind.setdefault(item.param.kind, []).append(item)
            if len(self._plans) >= 8:  # ZeRO-1/2 may requantise changing subsets
                self._plans.clear()
            cached = self._plans[key] = (lists, [PLAN[kind](items) for kind, items in by_kind.items()])
        with comm.traced("FSDP::fp8_requantize"), torch.no_grad():
            for plan in cached[1]:
                plan(self.group)

    def after_sync_backward(self) -> None:
        """Delayed scaling: one MAX all-reduce of every pending amax, then advance all histories."""
        if not self.delayed:
            return
        with comm.traced("FSDP::fp8_amax_reduce"), torch.no_grad():
            packed = pack_pending(self.delayed)
            comm.all_reduce_max(packed, self.amax_group)
            advance_all(self.delayed, packed)


# ------------------------------------------------------------------------- wrap time
def _native_fp8_modules(module: nn.Module) -> list[tuple[str, Float8Linear]]:
    return [(n, m) for n, m in module.named_modules() if isinstance(m, Float8Linear) and m.fp8_params]


def has_fp8_params(module: nn.Module) -> bool:
    """Whether ``module`` holds FP8 parameters (torch-native ``Float8Linear`` or TE quantized)."""
    return bool(_native_fp8_modules(module)) or module_has_te_fp8_params(module)


def check_fp8_params(module: nn.Module, strategy: ShardingStrategy, policy: MixedPrecisionPolicy,
                     keep_transpose: bool) -> None:
    """Wrap-time checks of FP8 parameters (before anything is allocated)."""
    native = _native_fp8_modules(module)
    te = module_has_te_fp8_params(module)
    if not native and not te:
        if keep_transpose:
            raise ValueError("keep_fp8_transpose_cache=True needs FP8 parameters (Float8Linear modules built "
                             "with fp8_params=True, or TransformerEngine modules built under "
                             "te.quantized_model_init); the module has none, so pass False")
        return
    names = [f"Float8Linear {n!r}" for n, _ in native[:3]] + (["TransformerEngine quantized weights"] if te else [])
    what = f"FP8 parameters ({', '.join(names)})"
    if strategy == ShardingStrategy.NO_SHARD:
        raise ValueError(f"{what} are not supported with zero_dp_strategy='no_shard'/0: nothing is gathered "
                         "there, every rank keeps the whole weight; allowed strategies: 'optim'/1, "
                         "'optim_grads'/2, 'optim_grads_params'/3 (or build the model without FP8 parameters)")
    if policy.main_params_dtype not in MAIN_DTYPES:
        raise ValueError(f"{what} need high-precision main parameters: pass mixed_precision_policy="
                         f"MixedPrecisionPolicy(main_params_dtype=torch.float32) (or torch.float64), got "
                         f"main_params_dtype={policy.main_params_dtype}")
    seen: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), name)
    for name, m in native:
        if isinstance(m.weight, DTensor):
            raise ValueError(f"FP8 parameter {name}.weight is a tensor-parallel DTensor; FP8 parameters are "
                             "not supported with tensor parallelism (use fp8_params=False)")
        if seen[id(m.weight)] != (f"{name}.weight" if name else "weight"):
            raise ValueError(f"FP8 parameter {name}.weight is tied to {seen[id(m.weight)]!r}; a tied weight "
                             "cannot be an FP8 parameter (its other user reads the high-precision value)")


def _fp8_param_of(p: ManagedParam, index: int, device: torch.device) -> Any | None:
    if is_te_quantized(p.unsharded):
        return TeFp8Param(p, index)
    module, name = p.locations[0]
    if isinstance(module, Float8Linear) and module.fp8_params and name == "weight":
        if len(p.locations) > 1:
            raise ValueError(f"FP8 parameter {p.fqn!r} is tied to another module; a tied weight cannot be "
                             "an FP8 parameter")
        free_storage(p.compute_local())  # never materialised: the module computes from its weight slot
        return NativeFp8Param(p, index, module, device)
    return None


def unit_fp8(unit: Any) -> UnitFp8 | None:
    """The FP8 side of a unit that has just sharded its params (``None``: no FP8 params)."""
    ctx = unit.ctx
    fp8 = [f for i, p in enumerate(unit.params) if (f := _fp8_param_of(p, i, ctx.device)) is not None]
    if not fp8:
        return None
    return UnitFp8(unit.params, fp8, ctx.num_shards, ctx.layout_rank, unit.dtypes.compute, ctx.device,
                   ctx.config.keep_fp8_transpose_cache, graph_mode=ctx.config.cuda_graph_mode)


def model_fp8(module: nn.Module, units: Sequence[Any], group: dist.ProcessGroup,
              amax_group: dist.ProcessGroup) -> ModelFp8 | None:
    """The model's ``ModelFp8`` (``None`` when it has neither FP8 params nor delayed-scaling FP8
    modules). Delayed-scaling quantizers are deferred: the engine advances them once per step."""
    delayed = delayed_quantizers(module)
    if not delayed and all(u.fp8 is None for u in units):
        return None
    set_deferred(delayed)
    return ModelFp8(group, amax_group, delayed)
