"""GradStaging: transient buffers behave as the engine always did; persistent ones (CUDA-graph
mode) keep their addresses, are rewritten or zeroed in place before reuse and hold reducer
inputs until the end of backward."""
from __future__ import annotations

import pytest
import torch

from fsdp_impl.grad_staging import GradStaging
from fsdp_impl.sharding import FlatLayout

CPU = torch.device("cpu")


@pytest.mark.parametrize("persistent", [False, True])
def test_pending_collects_one_backward(persistent: bool) -> None:
    s = GradStaging(FlatLayout([(2,), (2,)], 1), torch.float32, CPU, persistent)
    s.stash(0, torch.ones(2))
    first = s.take_pending(torch.float32)
    assert first.tolist() == [1.0, 1.0, 0.0, 0.0]
    s.stash(1, torch.full((2,), 2.0))  # next backward: the first one's grads are gone
    second = s.take_pending(torch.float32)
    assert second.tolist() == [0.0, 0.0, 2.0, 2.0]
    assert (second is first) == persistent
    # a backward in which no grad arrived still hands zeros to the (collective) reduction
    assert s.take_pending(torch.float32).tolist() == [0.0] * 4


def test_pending_packs_shards_casts_and_mixes_dtypes() -> None:
    """Two shards: each rank's rows of every param, padded, in the comm dtype."""
    s = GradStaging(FlatLayout([(3,), (2, 2)], 2), torch.float32, CPU, False)
    s.stash(0, torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16))
    s.stash(1, torch.tensor([[4.0, 5.0], [6.0, 7.0]]))  # another dtype: both cast first
    out = s.take_pending(torch.float32)
    assert out.dtype == torch.float32
    assert out.tolist() == [1.0, 2.0, 4.0, 5.0, 3.0, 0.0, 6.0, 7.0]


def test_clear_drops_stashed_grads() -> None:
    s = GradStaging(FlatLayout([(2,)], 1), torch.float32, CPU, False)
    s.stash(0, torch.ones(2))
    s.clear()
    assert s.take_pending(torch.float32).tolist() == [0.0, 0.0]


def test_persistent_pending_follows_comm_dtype() -> None:
    s = GradStaging(FlatLayout([(4,)], 1), torch.float32, CPU, True)
    a = s.take_pending(torch.float32)
    b = s.take_pending(torch.bfloat16)
    assert b.dtype == torch.bfloat16 and b is not a
    assert s.take_pending(torch.bfloat16) is b


@pytest.mark.parametrize("persistent", [False, True])
def test_accumulator_cycle(persistent: bool) -> None:
    s = GradStaging(FlatLayout([(3,)], 1), torch.float32, CPU, persistent)
    s.accumulator().add_(1.0)
    s.accumulator().add_(2.0)  # a second microbatch accumulates
    acc = s.accumulator()
    full = s.take_accumulated(torch.float32)
    assert full.tolist() == [3.0] * 3
    assert full is acc  # same dtype: the buffer itself is reduced (no copy)
    full.mul_(0.5)  # the reducer may work in place (no_shard all-reduce)
    assert s.accumulator().tolist() == [0.0] * 3  # the next cycle starts from zero
    assert (s.accumulator() is acc) == persistent


def test_persistent_holds_cast_copy_until_end_backward() -> None:
    s = GradStaging(FlatLayout([(2,)], 1), torch.float32, CPU, True)
    s.accumulator().add_(1.5)
    full = s.take_accumulated(torch.bfloat16)
    assert full.dtype == torch.bfloat16 and s._held == [full]
    s.end_backward()
    assert s._held == []


@pytest.mark.parametrize("persistent", [False, True])
def test_clear_drops_unsynced_grads(persistent: bool) -> None:
    s = GradStaging(FlatLayout([(2,)], 1), torch.float32, CPU, persistent)
    acc = s.accumulator().add_(4.0)
    s.clear()
    assert s.accumulator().tolist() == [0.0, 0.0]
    assert (s.accumulator() is acc) == persistent
    assert len(s.tensors()) == 1


def test_pack_plan_kept_only_for_buffers_that_outlive_the_pack() -> None:
    """One shard: packing into the caller's buffer keeps its views for the next pack (same values
    as without); a transient buffer of the staging's own is not planned, so nothing holds it
    after the reducer let go of it."""
    layout = FlatLayout([(2, 2), (3,)], 1)
    s = GradStaging(layout, torch.float32, CPU, False)
    target = torch.full((layout.total_numel,), float("nan"))
    for step in range(2):
        s.stash(0, torch.full((2, 2), float(step + 1)))
        s.stash(1, torch.arange(3.0))
        assert s.take_pending(torch.float32, out=target) is target
        assert target.tolist() == [float(step + 1)] * 4 + [0.0, 1.0, 2.0]
        assert s._plan is not None and s._plan.out is target
    transient = GradStaging(layout, torch.float32, CPU, False)
    transient.stash(1, torch.ones(3))
    assert transient.take_pending(torch.float32).tolist() == [0.0] * 4 + [1.0] * 3
    assert transient._plan is None
