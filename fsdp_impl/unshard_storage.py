"""Where a ZeRO-3 unit's unsharded compute params live between its unshard and its reshard.

ZeRO-3 units re-gather their full compute params before each forward and backward and drop
them afterwards. ``UnshardStorage`` picks how that memory is handled:

* ``RESIZE`` (the default outside CUDA-graph mode; FSDP2's scheme): every compute param keeps
  its own storage, re-allocated (``untyped_storage().resize_``) when a gather starts and freed
  (``resize_(0)``) at reshard. Memory follows the live units; the caching allocator sees an
  allocation and a free per unit per forward and backward.
* ``PERSISTENT``: every unit keeps its full compute params allocated for the model's lifetime;
  gathers overwrite them in place. Memory = a full compute copy of the model, addresses never
  change. The default under ``cuda_graph_mode=True``.
* ``POOL``: a fixed pool of ``slots`` buffers (2 = Megatron-FSDP's "double buffer"); the i-th
  non-root unit's compute params are permanent views into slot ``i % slots``, which is sized
  for the largest unit assigned to it (the root keeps its own storage: it stays unsharded for the
  whole forward and backward). Memory = ``slots`` x the largest unit, addresses never change.

Pool correctness. A gather lands in a temporary buffer on the gather stream and is copied into
the slot on the compute stream when the unit unshards (``claim``), so a slot is only ever
written in compute-stream order, after every kernel that read the previous occupant. What must
hold is logical: the previous occupant must not need its values any more.

* Forward: a non-root unit is unsharded only between its pre- and post-forward, so a slot held
  by another unsharded unit during forward means two units of one slot are live at once (nested
  unit calls); that raises instead of corrupting.
* Backward: autograd runs the nodes of one device in decreasing creation order, so when unit
  ``j``'s pre-backward fires every node created after ``j``'s forward (every later unit's
  backward, frozen or unused params included) has been enqueued. Another unit still holding the
  slot then is done with it and is evicted (marked resharded; it re-gathers if it runs again).
  This needs units that do not nest.
* Recompute (activation checkpointing): a checkpointed region's forward runs again inside the
  backward of its last unit, so the units of the region are unsharded together with the unit
  whose backward is running. Every pre-backward starts a new *backward epoch*
  (``UnshardPool.next_epoch``); a recompute gather may evict an occupant claimed in an earlier
  epoch (its backward has run, as above), but an occupant claimed in the current epoch is still
  needed by the backward in progress, so that claim raises (the region holds more units than
  the pool has slots) instead of overwriting values autograd will read.

Because slots are only written on the compute stream, one slot is already correct and more
slots only cost memory; ``double_buffer()`` has two to match the Megatron-FSDP arguments that
select it (whose gathers write into the buffers directly). The price of writing on the compute
stream is the temporary gather buffer, as under RESIZE.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .policy import check_bool

# Params inside a pool slot start at multiples of this many bytes, like blocks of the CUDA
# caching allocator, so kernels see the alignment they would see on standalone tensors.
SLOT_ALIGN_BYTES = 512


class UnshardStorageKind(enum.Enum):
    AUTO = "auto"  # RESIZE, or PERSISTENT under cuda_graph_mode=True
    RESIZE = "resize"
    PERSISTENT = "persistent"
    POOL = "pool"


@dataclass(frozen=True)
class UnshardStorage:
    """The unshard-storage option of one wrapped model (engine-internal; see the module doc).

    ``UnshardStorage()`` is the default; ``UnshardStorage.double_buffer()`` the 2-slot pool;
    ``UnshardStorage.from_megatron_args(fsdp_double_buffer, maxpool_double_buffer)`` maps
    Megatron-FSDP's arguments onto it. Only ZeRO-3 (``optim_grads_params``) units are affected:
    ZeRO-0/1/2 compute params are persistent by design.
    """

    kind: UnshardStorageKind = UnshardStorageKind.AUTO
    slots: int = 2  # POOL only

    def __post_init__(self) -> None:
        if not isinstance(self.kind, UnshardStorageKind):
            allowed = ", ".join(k.name for k in UnshardStorageKind)
            raise ValueError(f"UnshardStorage kind must be an UnshardStorageKind ({allowed}), got {self.kind!r}")
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"UnshardStorage slots must be an int >= 1, got {self.slots!r}")

    @classmethod
    def double_buffer(cls, slots: int = 2) -> UnshardStorage:
        return cls(UnshardStorageKind.POOL, slots)

    @classmethod
    def from_megatron_args(cls, fsdp_double_buffer: bool = False,
                           maxpool_double_buffer: bool = False) -> UnshardStorage:
        """Megatron-FSDP's ``fsdp_double_buffer`` (a symmetric fixed pool) and
        ``maxpool_double_buffer`` (a pool sized by the largest unit, which implies the former)
        both map to the 2-slot pool: each slot is sized for the largest unit assigned to it,
        which covers symmetric and asymmetric units alike."""
        check_bool("fsdp_double_buffer", fsdp_double_buffer)
        check_bool("maxpool_double_buffer", maxpool_double_buffer)
        return cls.double_buffer() if fsdp_double_buffer or maxpool_double_buffer else cls()

    def resolve(self, cuda_graph_mode: bool) -> UnshardStorage:
        """Replace AUTO by the concrete kind; reject RESIZE under CUDA-graph mode."""
        if self.kind == UnshardStorageKind.AUTO:
            kind = UnshardStorageKind.PERSISTENT if cuda_graph_mode else UnshardStorageKind.RESIZE
            return UnshardStorage(kind, self.slots)
        if cuda_graph_mode and self.kind == UnshardStorageKind.RESIZE:
            raise ValueError("cuda_graph_mode=True cannot use the RESIZE unshard storage: it allocates "
                             "and frees the ZeRO-3 compute params on every unshard/reshard, so a captured "
                             "graph would read and write memory it does not own; use UnshardStorageKind."
                             "PERSISTENT (the graph-mode default) or POOL (double buffer)")
        return self

    def standalone_kind(self, cuda_graph_mode: bool) -> UnshardStorageKind:
        """The kind of units that have storage of their own (all units, or under POOL the root)."""
        if self.kind == UnshardStorageKind.POOL:
            return UnshardStorageKind.PERSISTENT if cuda_graph_mode else UnshardStorageKind.RESIZE
        return self.kind


class GatherPhase(enum.Enum):
    """Why a unit is unsharded: its forward, its backward (pre-backward), or the recompute of a
    checkpointed region's forward during the backward (activation checkpointing)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"


class SlotUser(Protocol):
    """What the pool needs from a unit (``FSDPUnit``) that occupies a slot."""

    name: str

    @property
    def is_unsharded(self) -> bool: ...

    def evict(self) -> None:
        """Forget that the compute params are valid (the slot now holds another unit's)."""


class UnitStorage(Protocol):
    """One unit's compute-param storage; the unit calls these at its transitions."""

    def on_gather_start(self) -> None:
        """A gather for this unit is about to start."""

    def on_unshard(self, user: SlotUser, phase: GatherPhase) -> None:
        """The gathered values are about to be copied into the compute params."""

    def on_reshard(self, user: SlotUser) -> None:
        """The compute params are no longer needed."""

    def on_pre_backward(self) -> None:
        """A unit's pre-backward fired (a new backward epoch for pooled storage)."""


class ResizeStorage:
    """FSDP2's scheme: allocate each compute param's storage when a gather starts, free it at
    reshard (autograd's saved references stay valid objects)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        # Each tensor's storage object and full byte size, looked up once (every unshard and
        # reshard touches all of them); the tensors keep their storage objects for life.
        self._storages = [(t.untyped_storage(), t.numel() * t.element_size()) for t in self.tensors]

    def on_gather_start(self) -> None:
        for storage, need in self._storages:
            if storage.size() != need:
                storage.resize_(need)

    def on_unshard(self, user: SlotUser, phase: GatherPhase) -> None:
        """The storage was allocated when the gather started."""

    def on_reshard(self, user: SlotUser) -> None:
        for storage, _ in self._storages:
            storage.resize_(0)

    def on_pre_backward(self) -> None:
        """Nothing is shared."""


class PersistentStorage:
    """The compute params keep the storage they were allocated with."""

    def on_gather_start(self) -> None:
        """Nothing to allocate."""

    def on_unshard(self, user: SlotUser, phase: GatherPhase) -> None:
        """Nothing to claim."""

    def on_reshard(self, user: SlotUser) -> None:
        """Nothing to free."""

    def on_pre_backward(self) -> None:
        """Nothing is shared."""


def unit_storage(kind: UnshardStorageKind, tensors: Sequence[torch.Tensor]) -> UnitStorage:
    """Storage of a unit that does not live in a pool (RESIZE or PERSISTENT)."""
    if kind == UnshardStorageKind.RESIZE:
        return ResizeStorage(tensors)
    if kind == UnshardStorageKind.PERSISTENT:
        return PersistentStorage()
    raise ValueError(f"unit_storage needs RESIZE or PERSISTENT, got {kind}")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES


def slot_offsets(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offset of each tensor inside a slot (aligned), and the bytes the unit needs."""
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += _aligned(t.numel() * t.element_size())
    return offsets, total


class UnshardPool:
    """``slots`` fixed byte buffers shared by the pooled units (see the module doc)."""

    def __init__(self, units: Sequence[Sequence[torch.Tensor]], slots: int, device: torch.device) -> None:
        """``units``: per pooled unit (in the engine's unit order) its compute tensors."""
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slot_of = [i % slots for i in range(len(units))]
        layouts = [slot_offsets(tensors) for tensors in units]
        sizes = [0] * slots
        for i, (_, total) in enumerate(layouts):
            sizes[self.slot_of[i]] = max(sizes[self.slot_of[i]], total)
        self.buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        self._occupant: list[SlotUser | None] = [None] * slots
        self._claimed_in: list[int] = [0] * slots  # backward epoch of each slot's last claim
        self.epoch = 0
        for i, tensors in enumerate(units):
            base = self.buffers[self.slot_of[i]]
            for t, offset in zip(tensors, layouts[i][0], strict=True):
                view = base.narrow(0, offset, t.numel() * t.element_size()).view(t.dtype).view(t.shape)
                t.data = view  # the tensor object (what autograd saves) stays; only its memory moves

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers)

    def occupant(self, slot: int) -> SlotUser | None:
        return self._occupant[slot]

    def next_epoch(self) -> None:
        """A pre-backward fired: occupants claimed before it are done (see the module doc)."""
        self.epoch += 1

    def claim(self, slot: int, user: SlotUser, phase: GatherPhase) -> None:
        """``user`` is about to write its values into ``slot``."""
        current = self._occupant[slot]
        if current is not None and current is not user and current.is_unsharded:
            if phase == GatherPhase.FORWARD:
                raise RuntimeError(
                    f"unshard storage pool: units {current.name!r} and {user.name!r} share slot {slot} "
                    "and would both be unsharded during forward (nested unit calls?); use more "
                    "slots or the PERSISTENT/RESIZE unshard storage")
            if phase == GatherPhase.RECOMPUTE and self._claimed_in[slot] == self.epoch:
                raise RuntimeError(
                    f"unshard storage pool: the activation recompute of unit {user.name!r} needs pool slot "
                    f"{slot}, which holds unit {current.name!r} whose backward is still running: one "
                    f"checkpointed region spans more units than the pool's {len(self.buffers)} slots; "
                    "use UnshardStorage.double_buffer(slots=N) with N >= the units per checkpointed "
                    "region + 1, checkpoint fewer units per region, or the RESIZE/PERSISTENT storage")
            current.evict()
        self._occupant[slot] = user
        self._claimed_in[slot] = self.epoch

    def vacate(self, slot: int, user: SlotUser) -> None:
        if self._occupant[slot] is user:
            self._occupant[slot] = None


class PooledStorage:
    """A unit whose compute params are views into one slot of an ``UnshardPool``."""

    def __init__(self, pool: UnshardPool, slot: int) -> None:
        self.pool = pool
        self.slot = slot

    def on_gather_start(self) -> None:
        """The gather lands in a temporary buffer; the slot is claimed at the copy-out."""

    def on_unshard(self, user: SlotUser, phase: GatherPhase) -> None:
        self.pool.claim(self.slot, user, phase)

    def on_reshard(self, user: SlotUser) -> None:
        self.pool.vacate(self.slot, user)

    def on_pre_backward(self) -> None:
        self.pool.next_epoch()


def build_pool(units: Sequence[Sequence[torch.Tensor]], slots: int,
               device: torch.device) -> tuple[UnshardPool, list[PooledStorage]]:
    """The pool for ``units`` (their compute tensors, engine order) and each unit's storage."""
    pool = UnshardPool(units, slots, device)
    return pool, [PooledStorage(pool, slot) for slot in pool.slot_of]
