"""Pure shard arithmetic (no torch.distributed): which rows of a parameter each rank holds and
where every parameter lives in a unit's flat, padded communication buffer.

Semantics follow ``torch.chunk`` / DTensor ``Shard(0)``: every rank gets ``ceil(rows / n)`` rows
except trailing ranks, which get fewer or none. A unit's per-rank segment reserves
``ceil(rows / n) * row_numel`` elements for each parameter so that one all-gather / one
reduce-scatter of equal-sized segments moves the whole unit.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


def chunk_rows(rows: int, num_shards: int) -> int:
    """Rows per shard (the padded shard height) under torch.chunk semantics."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return -(-rows // num_shards) if rows > 0 else 0


def shard_row_range(rows: int, num_shards: int, rank: int) -> tuple[int, int]:
    """[start, end) rows held by ``rank``; empty (start == end) for trailing ranks."""
    if not 0 <= rank < num_shards:
        raise ValueError(f"rank must be in [0, {num_shards}), got {rank}")
    c = chunk_rows(rows, num_shards)
    return min(rank * c, rows), min((rank + 1) * c, rows)


@dataclass(frozen=True)
class ParamSlot:
    """Where one parameter lives: its global shape and its offset in the per-rank segment."""

    shape: tuple[int, ...]
    offset: int  # element offset inside one rank's segment
    chunk: int  # padded rows per rank

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @functools.cached_property  # hot (every gather and grad pack); the slot is immutable
    def row_numel(self) -> int:
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n

    @functools.cached_property
    def padded_numel(self) -> int:
        """Elements reserved in each rank's segment."""
        return self.chunk * self.row_numel

    def local_shape(self, num_shards: int, rank: int) -> tuple[int, ...]:
        start, end = shard_row_range(self.rows, num_shards, rank)
        return (end - start,) + tuple(self.shape[1:]) if self.shape else ()


class FlatLayout:
    """The packing of a list of parameter shapes into equal per-rank segments."""

    def __init__(self, shapes: Sequence[Sequence[int]], num_shards: int) -> None:
        self.num_shards = num_shards
        self.slots: list[ParamSlot] = []
        offset = 0
        for shape in shapes:
            shape = tuple(int(s) for s in shape)
            if len(shape) == 0:
                raise ValueError("0-dim parameters must be viewed as shape (1,) before layout")
            slot = ParamSlot(shape, offset, chunk_rows(shape[0], num_shards))
            self.slots.append(slot)
            offset += slot.padded_numel
        self.segment_numel = offset
        self.split_sizes = [slot.padded_numel for slot in self.slots]  # per-param columns of a segment

    @property
    def total_numel(self) -> int:
        return self.segment_numel * self.num_shards

    def local_view(self, segment: torch.Tensor, index: int, rank: int) -> torch.Tensor:
        """The shard of parameter ``index`` that ``rank`` holds, as a view into its segment."""
        slot = self.slots[index]
        local = slot.local_shape(self.num_shards, rank)
        n = local[0] * slot.row_numel
        return segment.narrow(0, slot.offset, n).view(local)

    def pack_full(self, out: torch.Tensor, index: int, full: torch.Tensor, accumulate: bool = False) -> None:
        """Copy (or add) a full tensor into its padded slots of ``out`` ([num_shards, segment])."""
        slot = self.slots[index]
        dst = out.view(self.num_shards, self.segment_numel).narrow(1, slot.offset, slot.padded_numel)
        flat = full.reshape(-1)
        pad = slot.padded_numel * self.num_shards - flat.numel()
        if pad:
            flat = torch.nn.functional.pad(flat, (0, pad))
        src = flat.view(self.num_shards, slot.padded_numel)
        if accumulate:
            dst.add_(src)
        else:
            dst.copy_(src)

    def pack_all(self, out: torch.Tensor, fulls: Sequence[torch.Tensor], fused: bool = True,
                 plan: PackPlan | None = None) -> None:
        """Copy one full tensor per slot (same dtype; ``out`` may be wider) into ``out``
        ([num_shards, segment]), writing every element (padding as zeros).

        ``fused``: one op, ``torch._chunk_cat``, which pads each tensor's rows to a multiple of
        ``num_shards`` and concatenates the chunks of each shard, exactly this layout (one kernel
        on CUDA, the cast included). Its CUDA kernel uploads its metadata from a temporary
        pinned host buffer, which a captured CUDA graph would read again at replay after it was
        freed, so CUDA-graph mode passes ``fused=False``: multi-tensor ``_foreach_copy_`` /
        ``_foreach_zero_`` over the (param, shard) pieces (``pieces``), whose addresses travel
        as kernel arguments. Empty params occupy no space and are left out (``_chunk_cat``
        refuses empty tensors). One shard (world 1) has no padding and one range per parameter:
        one multi-tensor copy, whatever ``fused`` says (``plan``: ``pack_plan(out)`` made earlier,
        whose views of ``out`` are used when ``fulls`` have their slots' shapes; else
        ``_solo_pairs``)."""
        segments = out.view(self.num_shards, self.segment_numel)
        if self.num_shards == 1:
            if plan is not None and plan.out is out:
                srcs = [fulls[i] for i in plan.slots]
                if all(src.shape == view.shape for src, view in zip(srcs, plan.views, strict=True)):
                    _copy_lists(plan.views, srcs)
                    return
            _copy_lists(*self._solo_pairs(segments[0], fulls, into_segment=True))
            return
        if not fused:
            flats = [f.reshape(-1) for f in fulls]
            dsts, srcs, pads = [], [], []
            for i, row, col, start, length in self.pieces:
                padded = self.slots[i].padded_numel
                if length:
                    dsts.append(segments[row].narrow(0, col, length))
                    srcs.append(flats[i].narrow(0, start, length))
                if length < padded:
                    pads.append(segments[row].narrow(0, col + length, padded - length))
            _copy_lists(dsts, srcs)
            if pads:
                torch._foreach_zero_(pads)
            return
        filled = [f for f, slot in zip(fulls, self.slots, strict=True) if slot.padded_numel]
        if filled:
            torch._chunk_cat(filled, dim=0, num_chunks=self.num_shards, out=segments)

    @functools.cached_property
    def pieces(self) -> list[tuple[int, int, int, int, int]]:
        """``(slot, shard, column, start, length)`` per parameter and shard: the shard's part of
        the parameter is its flat elements ``[start, start + length)``, stored at ``column`` of
        that shard's segment row and followed by ``padded_numel - length`` padding elements."""
        out = []
        for i, slot in enumerate(self.slots):
            numel = slot.padded_numel and slot.rows * slot.row_numel
            for row in range(self.num_shards):
                start = row * slot.padded_numel
                out.append((i, row, slot.offset, start, max(0, min(slot.padded_numel, numel - start))))
        return out

    def unpack_all(self, src: torch.Tensor, fulls: Sequence[torch.Tensor], fused: bool = True,
                   plan: UnpackPlan | None = None) -> None:
        """Copy every parameter out of a gathered buffer ``src`` ([num_shards, segment]).

        ``fused``: one ``split_with_sizes_copy`` (one kernel on CUDA; a parameter whose rows do
        not split evenly has no [num_shards, padded] view, so it lands in a temporary first).
        ``plan``: ``unpack_plan(fulls)`` made earlier for these very tensors (a unit keeps it, so
        the views are not rebuilt every gather). ``fused=False`` (CUDA-graph mode, see
        ``pack_all``): ``_foreach_copy_`` over the pieces. One shard: one multi-tensor copy per
        dtype of ``fulls`` (the plan's flat views, else ``_solo_pairs``), which may also cast
        (``src`` in another dtype than ``fulls``)."""
        n = self.num_shards
        segments = src.view(n, self.segment_numel)
        if n == 1:
            if plan is not None and plan.solo is not None:
                ranges = segments[0].split_with_sizes(self.split_sizes)  # one call for every view
                for slots, dsts in plan.solo:
                    torch._foreach_copy_(dsts, [ranges[i] for i in slots])
                return
            _copy_lists(*self._solo_pairs(segments[0], fulls, into_segment=False))
            return
        if not fused:
            views = [f.view(-1) for f in fulls]  # compute params are contiguous
            pieces = [(i, row, col, start, length) for i, row, col, start, length in self.pieces if length]
            _copy_lists([views[i].narrow(0, start, length) for i, _, _, start, length in pieces],
                        [segments[row].narrow(0, col, length) for _, row, col, _, length in pieces])
            return
        plan = self.unpack_plan(fulls) if plan is None else plan
        if plan.dense is not None:
            torch.split_with_sizes_copy(segments, self.split_sizes, dim=1, out=plan.dense)
            return
        outs: list[torch.Tensor] = []
        uneven: list[tuple[torch.Tensor, torch.Tensor]] = []
        for view, slot, full in zip(plan.outs, self.slots, fulls, strict=True):
            if view is None:
                view = torch.empty(n, slot.padded_numel, dtype=src.dtype, device=src.device)
                uneven.append((view, full))
            outs.append(view)
        torch.split_with_sizes_copy(segments, self.split_sizes, dim=1, out=outs)
        for tmp, full in uneven:
            full.view(-1).copy_(tmp.view(-1)[: full.numel()])

    def _solo_pairs(self, row: torch.Tensor, fulls: Sequence[torch.Tensor],
                    into_segment: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources) between the one segment ``row`` of a one-shard layout and
        ``fulls``: each parameter is the range ``[offset, offset + numel)`` of the segment, with
        no padding, so a copy is one ``_foreach_copy_`` (casting, any strides; empty parameters
        left out). On an H200 a 12-parameter block took 29 us of host time this way against
        71 us for ``split_with_sizes_copy`` and 270 us for ``_chunk_cat`` casting bf16 to fp32
        (which also loads its metadata through a pinned host buffer)."""
        views, others = [], []
        pieces = row.split_with_sizes(self.split_sizes)  # one call instead of a narrow per param
        for slot, piece, full in zip(self.slots, pieces, fulls, strict=True):
            if slot.padded_numel:
                views.append(piece.view(full.shape))
                others.append(full)
        return (views, others) if into_segment else (others, views)

    def pack_plan(self, out: torch.Tensor) -> PackPlan | None:
        """One shard: the views ``pack_all`` writes through for this very ``out`` (a buffer that
        outlives the plan: the plan holds it), one per non-empty slot in its shape; None otherwise."""
        if self.num_shards != 1:
            return None
        pieces = out.view(self.segment_numel).split_with_sizes(self.split_sizes)
        slots = [i for i, slot in enumerate(self.slots) if slot.padded_numel]
        return PackPlan(out, slots, [pieces[i].view(self.slots[i].shape) for i in slots])

    def unpack_plan(self, fulls: Sequence[torch.Tensor]) -> UnpackPlan:
        """Per slot the ``[num_shards, padded]`` view of its full tensor that ``unpack_all``
        copies into, or None where there is none (rows not a multiple of the shards, or not
        contiguous: a temporary then). The views stay valid while the tensors keep their storage
        object, also across ``untyped_storage().resize_`` (a view reads the storage's address)."""
        outs: list[torch.Tensor | None] = []
        for slot, full in zip(self.slots, fulls, strict=True):
            even = slot.padded_numel * self.num_shards == full.numel()
            outs.append(full.view(self.num_shards, slot.padded_numel) if even and full.is_contiguous() else None)
        dense = [o for o in outs if o is not None]
        return UnpackPlan(outs, dense if len(dense) == len(outs) else None, self._solo_plan(fulls))

    def _solo_plan(self, fulls: Sequence[torch.Tensor]) -> list[tuple[list[int], list[torch.Tensor]]] | None:
        """One shard: per dtype of ``fulls``, the non-empty slots' indices and their tensors as flat
        views, so an unpack is one ``split_with_sizes`` of the segment plus one ``_foreach_copy_``
        per dtype (a world-1 unit unshards twice a step, and building a view per parameter each
        time was most of its host time); None where a tensor is not contiguous (no flat view)."""
        if self.num_shards != 1 or not all(f.is_contiguous() for f in fulls):
            return None
        groups: dict[torch.dtype, tuple[list[int], list[torch.Tensor]]] = {}
        for i, (slot, full) in enumerate(zip(self.slots, fulls, strict=True)):
            if slot.padded_numel:
                slots, dsts = groups.setdefault(full.dtype, ([], []))
                slots.append(i)
                dsts.append(full.view(-1))
        return list(groups.values())


@dataclass
class PackPlan:
    """Where a one-shard ``FlatLayout.pack_all`` into ``out`` writes (``FlatLayout.pack_plan``)."""

    out: torch.Tensor
    slots: list[int]  # the non-empty slots
    views: list[torch.Tensor]  # each one's range of ``out``, in the slot's shape


@dataclass
class UnpackPlan:
    """Where ``FlatLayout.unpack_all`` writes each parameter (see ``FlatLayout.unpack_plan``)."""

    outs: list[torch.Tensor | None]
    dense: list[torch.Tensor] | None  # every view, when each parameter has one (no temporaries)
    # one shard: (slot indices, flat views of their tensors) per dtype (``FlatLayout._solo_plan``)
    solo: list[tuple[list[int], list[torch.Tensor]]] | None = None


def _copy_lists(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, as one ``_foreach_copy_`` per (dst, src) dtype pair."""
    groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs, strict=True):
        pair = groups.setdefault((d.dtype, s.dtype), ([], []))
        pair[0].append(d)
        pair[1].append(s)
    for d_list, s_list in groups.values():
        torch._foreach_copy_(d_list, s_list)
