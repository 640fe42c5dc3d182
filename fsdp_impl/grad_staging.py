"""Where one unit's full-size grads wait for their reduction.

* ZeRO-2/3: ``pending(dtype)`` collects this backward's grads in the comm dtype; the unit hands
  it to its reducer once per backward (``take_pending``).
* ZeRO-0/1: ``accumulator()`` sums grads over the microbatches of a cycle in the main-grads
  dtype until the sync backward reduces it (``take_accumulated``).

Transient (the default): buffers are allocated zero-filled on first use and dropped once handed
to the reducer (which keeps them alive on its stream with ``record_stream``); the ZeRO-0/1
accumulator exists only while a cycle accumulates.

Persistent (CUDA-graph mode): each buffer is allocated once and zeroed in place before reuse,
so the addresses a captured graph uses never change. A tensor made for the reducer (a cast of
the accumulator to the comm dtype) is held until ``end_backward``, when the compute stream has
waited for the reduction, instead of ``record_stream``.
"""
from __future__ import annotations

import torch


class GradStaging:
    """The pending / accumulator buffers of one unit (``numel`` = its full padded grad size)."""

    def __init__(self, numel: int, main_dtype: torch.dtype, device: torch.device, persistent: bool) -> None:
        self.numel = numel
        self.main_dtype = main_dtype
        self.device = device
        self.persistent = persistent
        self._pending: torch.Tensor | None = None
        self._pending_open = False  # persistent: this backward's grads are being collected
        self._pending_dirty = False  # persistent: holds the last backward's grads
        self._accumulator: torch.Tensor | None = None
        self._accumulator_dirty = False  # persistent: holds grads that were already reduced
        self._held: list[torch.Tensor] = []

    def _zeros(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ ZeRO-2/3
    def pending(self, dtype: torch.dtype) -> torch.Tensor:
        """This backward's grad buffer in ``dtype`` (zero where no grad arrived yet)."""
        if not self.persistent:
            if self._pending is None:
                self._pending = self._zeros(dtype)
            return self._pending
        if self._pending is None or self._pending.dtype != dtype:
            self._pending = self._zeros(dtype)  # first use, or the comm dtype changed
            self._pending_dirty = False
        if not self._pending_open:
            if self._pending_dirty:
                self._pending.zero_()
            self._pending_open = True
        return self._pending

    def take_pending(self, dtype: torch.dtype) -> torch.Tensor:
        """The buffer to reduce (all zeros when no grad arrived, so every rank still joins)."""
        if not self.persistent:
            full = self._pending if self._pending is not None else self._zeros(dtype)
            self._pending = None
            return full
        full = self.pending(dtype)
        self._pending_open = False
        self._pending_dirty = True
        return full

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
        """``zero_grad``: forget the unsynced accumulated grads."""
        if not self.persistent:
            self._accumulator = None
        elif self._accumulator is not None:
            self._accumulator.zero_()
            self._accumulator_dirty = False

    def tensors(self) -> list[torch.Tensor]:
        """The buffers currently allocated (to check that their addresses stay fixed)."""
        return [t for t in (self._pending, self._accumulator) if t is not None]
