"""The ZeRO-3 unshard-storage policy: option parsing, pool slot assignment and sizing, views,
and the pool's liveness rules (raise on a forward overlap, evict in backward)."""
from __future__ import annotations

import pytest
import torch

from fsdp_impl.unshard_storage import (
    SLOT_ALIGN_BYTES,
    GatherPhase,
    PersistentStorage,
    ResizeStorage,
    UnshardPool,
    UnshardStorage,
    UnshardStorageKind,
    build_pool,
    slot_offsets,
    unit_storage,
)

AUTO, RESIZE, PERSISTENT, POOL = (UnshardStorageKind.AUTO, UnshardStorageKind.RESIZE,
                                  UnshardStorageKind.PERSISTENT, UnshardStorageKind.POOL)


@pytest.mark.parametrize("db,maxpool,kind", [(False, False, AUTO), (True, False, POOL), (False, True, POOL),
                                             (True, True, POOL)])
def test_from_megatron_args(db: bool, maxpool: bool, kind: UnshardStorageKind) -> None:
    storage = UnshardStorage.from_megatron_args(fsdp_double_buffer=db, maxpool_double_buffer=maxpool)
    assert storage.kind == kind and storage.slots == 2


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="slots must be an int >= 1, got 0"):
        UnshardStorage(POOL, 0)
    with pytest.raises(ValueError, match="slots must be an int >= 1, got True"):
        UnshardStorage(POOL, True)
    with pytest.raises(ValueError, match="kind must be an UnshardStorageKind"):
        UnshardStorage("pool", 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="fsdp_double_buffer must be True or False, got 1"):
        UnshardStorage.from_megatron_args(fsdp_double_buffer=1)  # type: ignore[arg-type]


def test_resolve() -> None:
    assert UnshardStorage().resolve(False).kind == RESIZE  # outside graph mode: unchanged default
    assert UnshardStorage().resolve(True).kind == PERSISTENT
    assert UnshardStorage.double_buffer().resolve(True) == UnshardStorage(POOL, 2)
    with pytest.raises(ValueError, match="cuda_graph_mode=True cannot use the RESIZE unshard storage"):
        UnshardStorage(RESIZE).resolve(True)
    # under POOL the root (and anything unpooled) keeps its own storage of the mode's default kind
    assert UnshardStorage.double_buffer().standalone_kind(False) == RESIZE
    assert UnshardStorage.double_buffer().standalone_kind(True) == PERSISTENT
    with pytest.raises(ValueError, match="RESIZE or PERSISTENT"):
        unit_storage(POOL, [])


def test_slot_offsets_are_aligned() -> None:
    tensors = [torch.empty(3, dtype=torch.float32), torch.empty(0), torch.empty(200, dtype=torch.bfloat16),
               torch.empty(1, dtype=torch.float64)]
    offsets, total = slot_offsets(tensors)
    assert offsets == [0, 512, 512, 1024]
    assert total == 1024 + SLOT_ALIGN_BYTES
    assert all(o % SLOT_ALIGN_BYTES == 0 for o in offsets)


def _units() -> list[list[torch.Tensor]]:
    """Three units of different sizes and dtypes (unit 1 is the largest of slot 1)."""
    return [[torch.full((4, 4), 1.0), torch.full((4,), 2.0)],
            [torch.full((300,), 3.0, dtype=torch.bfloat16)],
            [torch.full((2, 8), 4.0)]]


def test_pool_slots_sized_by_parity_and_tensors_become_views() -> None:
    units = _units()
    ids = [[id(t) for t in ts] for ts in units]
    pool, storages = build_pool(units, 2, torch.device("cpu"))
    assert pool.slot_of == [0, 1, 0] and [s.slot for s in storages] == [0, 1, 0]
    # slot 0 holds unit 0 (2 tensors, 1024 B aligned) or unit 2 (64 B -> 512); slot 1 unit 1 (600 -> 1024)
    assert [b.numel() for b in pool.buffers] == [1024, 1024] and pool.nbytes == 2048
    for slot, ts in zip(pool.slot_of, units, strict=True):
        base = pool.buffers[slot].untyped_storage().data_ptr()
        for t in ts:
            assert t.untyped_storage().data_ptr() == base  # a view into the slot
    assert [[id(t) for t in ts] for ts in units] == ids  # same objects (what autograd saved)
    # units 0 and 2 share memory: writing one is visible through the other (hence the rules below)
    units[2][0].fill_(7.0)
    assert units[0][0].flatten()[0].item() == 7.0
    assert units[2][0].dtype == torch.float32 and units[1][0].dtype == torch.bfloat16
    assert units[0][0]._version == 0  # each tensor keeps its own version counter


class _User:
    def __init__(self, name: str) -> None:
        self.name = name
        self.is_unsharded = False
        self.evicted = 0

    def evict(self) -> None:
        self.evicted += 1
        self.is_unsharded = False


def _pool_of_two_users() -> tuple[UnshardPool, _User, _User]:
    pool = UnshardPool([[torch.empty(4)], [torch.empty(4)]], 1, torch.device("cpu"))
    return pool, _User("a"), _User("b")


def test_claim_forward_overlap_raises() -> None:
    pool, a, b = _pool_of_two_users()
    pool.claim(0, a, phase=GatherPhase.FORWARD)
    a.is_unsharded = True
    pool.claim(0, a, phase=GatherPhase.FORWARD)  # re-claim by the occupant is fine
    with pytest.raises(RuntimeError, match="units 'a' and 'b' share slot 0 and would both be unsharded during forward"):
        pool.claim(0, b, phase=GatherPhase.FORWARD)
    assert pool.occupant(0) is a and a.evicted == 0


def test_claim_after_reshard_and_backward_eviction() -> None:
    pool, a, b = _pool_of_two_users()
    pool.claim(0, a, phase=GatherPhase.FORWARD)
    a.is_unsharded = True
    pool.vacate(0, b)  # only the occupant vacates
    assert pool.occupant(0) is a
    pool.vacate(0, a)
    a.is_unsharded = False
    pool.claim(0, b, phase=GatherPhase.FORWARD)
    assert pool.occupant(0) is b and a.evicted == 0
    b.is_unsharded = True
    pool.claim(0, a, phase=GatherPhase.BACKWARD)  # backward: b is done (later in forward order) and evicted
    assert pool.occupant(0) is a and b.evicted == 1 and not b.is_unsharded


def test_recompute_claim_evicts_only_units_of_earlier_backward_epochs() -> None:
    """A recompute (a checkpointed region's forward run again inside the backward) may take a
    slot from a unit whose backward ran in an earlier epoch, never from one claimed in the
    current epoch: that unit's backward is still running and reads the slot."""
    pool, a, b = _pool_of_two_users()
    pool.next_epoch()  # b's pre-backward
    pool.claim(0, b, phase=GatherPhase.BACKWARD)
    b.is_unsharded = True
    with pytest.raises(RuntimeError, match=r"recompute of unit 'a' needs pool slot 0, which holds unit 'b' "
                                           r"whose backward is still running.*more units than the pool's 1 slots"):
        pool.claim(0, a, phase=GatherPhase.RECOMPUTE)
    assert pool.occupant(0) is b and b.evicted == 0 and b.is_unsharded
    pool.next_epoch()  # a later unit's pre-backward: b's backward is over
    pool.claim(0, a, phase=GatherPhase.RECOMPUTE)
    assert pool.occupant(0) is a and b.evicted == 1


def test_resize_and_persistent_storage() -> None:
    t = torch.zeros(8)
    resize = ResizeStorage([t])
    resize.on_reshard(_User("a"))
    assert t.untyped_storage().size() == 0
    resize.on_gather_start()
    assert t.untyped_storage().size() == 8 * 4
    keep = torch.zeros(8)
    ptr = keep.data_ptr()
    persistent = PersistentStorage()
    persistent.on_gather_start()
    persistent.on_unshard(_User("a"), phase=GatherPhase.FORWARD)
    persistent.on_reshard(_User("a"))
    assert keep.untyped_storage().size() == 32 and keep.data_ptr() == ptr
