"""Where one unit's full-size grads wait for their reduction.

* ZeRO-2/3: ``stash`` keeps each grad of this backward as autograd produced it; once per
  backward the unit takes them packed into one buffer in the comm dtype (``take_pending``: one
  ``torch._chunk_cat``, casting and zero-padding included) and hands it to its reducer.
* ZeRO-0/1: ``accumulator()`` sums grads over the microbatches of a cycle in the main-grads
  dtype until the sync backward reduces it (``take_accumulated``).

Transient (the default): buffers are allocated on use and dropped once handed to the reducer
(which keeps them alive on its stream with ``record_stream``); the ZeRO-0/1 accumulator exists
only while a cycle accumulates.

Persistent (CUDA-graph mode): each buffer is allocated once and rewritten (the pending buffer)
or zeroed in place (the accumulator) before reuse, so the addresses a captured graph uses never
change. A tensor made for the reducer (a cast of the accumulator to the comm dtype) is held
until ``end_backward``, when the compute stream has waited for the reduction, instead of
``record_stream``.
"""
from __future__ import annotations

import torch

from .sharding import FlatLayout, PackPlan


class GradStaging:
    """The pending / accumulator buffers of one unit, laid out by ``layout`` (its grad layout)."""

    def __init__(self, layout: FlatLayout, main_dtype: torch.dtype, device: torch.device,
                 persistent: bool) -> None:
        self.layout = layout
        self.numel = layout.total_numel
        self.main_dtype = main_dtype
        self.device = device
        self.persistent = persistent
        self._stash: list[torch.Tensor | None] = [None] * len(layout.slots)
        self._pending: torch.Tensor | None = None  # persistent only
        self._accumulator: torch.Tensor | None = None
        self._accumulator_dirty = False  # persistent: holds grads that were already reduced
        self._held: list[torch.Tensor] = []
        self._plan: PackPlan | None = None  # one shard: views of the last long-lived pack target

    def _zeros(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ ZeRO-2/3
    def stash(self, slot: int, grad: torch.Tensor) -> None:
        """Keep this backward's grad of layout slot ``slot`` (a full, TP-local tensor)."""
        self._stash[slot] = grad

    def _own_buffer(self, dtype: torch.dtype) -> torch.Tensor:
        """The staging's pack buffer: kept across backwards when persistent, else a fresh one."""
        if not self.persistent:
            return torch.empty(self.numel, dtype=dtype, device=self.device)
        if self._pending is None or self._pending.dtype != dtype:
            self._pending = torch.empty(self.numel, dtype=dtype, device=self.device)
        return self._pending

    def take_pending(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        """This backward's stashed grads packed into one buffer in ``dtype`` (zeros where no grad
        arrived, so every rank still joins the reduction); the stash is emptied. ``out``: pack
        into it (``numel`` elements of ``dtype``) instead of a buffer of the staging's own; a
        buffer that outlives the call (the unit's grad buffer), since its one-shard views are
        kept for the next pack into it."""
        grads, self._stash = self._stash, [None] * len(self._stash)
        given = out is not None
        if out is None:
            out = self._own_buffer(dtype)
        arrived = [g for g in grads if g is not None]
        if not arrived:
            return out.zero_()
        src = arrived[0].dtype
        mixed = any(g.dtype != src for g in arrived)
        if mixed:  # one op needs one input dtype
            src = dtype
        fulls: list[torch.Tensor]
        if not mixed and len(arrived) == len(grads):  # the usual case: nothing to cast or fill
            fulls = arrived
        else:
            fulls = [g.to(src) if g is not None else torch.zeros(slot.shape, dtype=src, device=self.device)
                     for g, slot in zip(grads, self.layout.slots, strict=True)]
        self.layout.pack_all(out, fulls, fused=not self.persistent,  # see FlatLayout.pack_all
                             plan=self._pack_plan(out) if given or self.persistent else None)
        return out

    def _pack_plan(self, out: torch.Tensor) -> PackPlan | None:
        """The one-shard views of ``out``, kept while ``out`` stays the target: only for buffers that
        outlive the pack (the caller's grad buffer, a persistent pack buffer), since the plan holds
        them; a fresh pack buffer is neither planned nor kept."""
        if self._plan is None or self._plan.out is not out:
            self._plan = self.layout.pack_plan(out)
        return self._plan

    # ------------------------------------------------------------------ ZeRO-0/1
    def accumulator(self) -> torch.Tensor:
        """The full-size accumulator of this cycle (main-grads dtype)."""
        if self._accumulator is None:
            self._accumulator = self._zeros(self.main_dtype)
        elif self._accumulator_dirty:
            self._accumulator.zero_()
        self._accumulator_dirty = False
        return self._accumulator

    def take_accumulated(self, comm_dtype: torch.dtype) -> torch.Tensor:
        """The accumulated grads in ``comm_dtype`` for the sync reduction; the cycle restarts."""
        full = self.accumulator().to(comm_dtype)
        if not self.persistent:
            self._accumulator = None
            return full
        self._accumulator_dirty = True  # zeroed at the next use, after the reduction was waited for
        if full is not self._accumulator:
            self._held.append(full)
        return full

    # ------------------------------------------------------------------ lifecycle
    def end_backward(self) -> None:
        """The compute stream waited for this unit's reduction: drop held tensors."""
        self._held.clear()

    def clear(self) -> None:
        """``zero_grad``: forget the unsynced accumulated grads (and any stashed grad)."""
        self._stash = [None] * len(self._stash)
        if not self.persistent:
            self._accumulator = None
        elif self._accumulator is not None:
            self._accumulator.zero_()
            self._accumulator_dirty = False

    def tensors(self) -> list[torch.Tensor]:
        """The buffers currently allocated (to check that their addresses stay fixed)."""
        return [t for t in (self._pending, self._accumulator) if t is not None]
