"""Sharded quantisation == full-tensor quantisation, bit for bit.

Ranks are simulated in one process: each "rank" takes its rows (``torch.chunk`` semantics,
uneven and empty shards included), the MAX all-reduce is an elementwise max over the ranks'
packed amax buffers, and the concatenated FP8 bytes are compared with quantising the whole
tensor on one process.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_impl.fp8 import E4M3, E5M2, CurrentQuantizer, DelayedQuantizer
from fsdp_impl.fp8.sharded import ShardedQuantization, ShardedWeight
from fsdp_impl.sharding import shard_row_range

QUANTIZERS = {
    "tensorwise": lambda dt: CurrentQuantizer(dt),
    "tensorwise-pow2": lambda dt: CurrentQuantizer(dt, None, True),
    "block16x16": lambda dt: CurrentQuantizer(dt, (16, 16), True),
    "block32x32": lambda dt: CurrentQuantizer(dt, (32, 32), True),
    "block1x16": lambda dt: CurrentQuantizer(dt, (1, 16), True),
}


def run_sharded(quantizers: list, tensors: list[torch.Tensor], world: int):
    """Per simulated rank: shards -> packed partial amaxes; MAX over ranks; per rank: finish."""
    plans = []
    for rank in range(world):
        weights = []
        for q, t in zip(quantizers[rank], tensors, strict=True):
            start, end = shard_row_range(t.shape[0], world, rank)
            weights.append(ShardedWeight(q, t[start:end], (t.shape[0], t.shape[1]), start))
        plans.append(ShardedQuantization(weights))
    reduced = torch.stack([p.amax_buffer() for p in plans]).amax(dim=0)
    return [p.finish(reduced.clone()) for p in plans]


def gathered_bytes(results, index: int) -> torch.Tensor:
    return torch.cat([r[index].data.view(torch.uint8) for r in results])


@given(shapes=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 40)), min_size=1, max_size=3),
       world=st.integers(1, 9), kind=st.sampled_from(sorted(QUANTIZERS)), dtype=st.sampled_from([E4M3, E5M2]),
       seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_sharded_equals_full_bit_for_bit(shapes, world, kind, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed values with a random outlier so blocks get very different scales
    tensors = [torch.randn(r, c, generator=g) * torch.randn(r, 1, generator=g).exp() * 10 for r, c in shapes]
    make = QUANTIZERS[kind]
    results = run_sharded([[make(dtype) for _ in tensors] for _ in range(world)], tensors, world)
    for i, t in enumerate(tensors):
        full = make(dtype).quantize(t)
        assert torch.equal(gathered_bytes(results, i), full.data.view(torch.uint8)), (kind, t.shape, world)
        for r in results:  # every rank holds the full tensor's scales after the one reduction
            assert torch.equal(r[i].scale_inv, full.scale_inv)


def test_empty_and_uneven_shards():
    """5 rows over 4 ranks: chunks of 2, 2, 1, 0 rows; a 16x16 block spans ranks 0-2."""
    t = torch.randn(5, 16) * 100
    q = lambda: CurrentQuantizer(E4M3, (16, 16), True)  # noqa: E731
    results = run_sharded([[q()] for _ in range(4)], [t], 4)
    assert [r[0].data.shape[0] for r in results] == [2, 2, 1, 0]
    assert torch.equal(gathered_bytes(results, 0), q().quantize(t).data.view(torch.uint8))


def test_delayed_weights_share_history_across_ranks():
    """Delayed scaling: each rank casts with the same delayed scale and, after the reduction,
    records the same (global) amax, so the histories stay identical on every rank."""
    t1, t2 = torch.randn(12, 8), torch.randn(12, 8) * 50
    owners = [torch.nn.Module() for _ in range(3)]
    qs = [[DelayedQuantizer(E4M3, o, "weight", history_len=4)] for o in owners]
    ref = DelayedQuantizer(E4M3, torch.nn.Module(), "weight", history_len=4)
    for t in (t1, t2):
        results = run_sharded(qs, [t], 3)
        assert torch.equal(gathered_bytes(results, 0), ref.quantize(t).data.view(torch.uint8))
    for o in owners:
        assert torch.equal(o.fp8_weight_amax_history, ref.history)
        assert torch.equal(o.fp8_weight_scale, ref.scale)


def test_packed_buffer_layout_is_list_order():
    a, b = torch.ones(4, 4), torch.full((2, 32), 3.0)
    plan = ShardedQuantization([ShardedWeight(CurrentQuantizer(E4M3), a, (4, 4), 0),
                                ShardedWeight(CurrentQuantizer(E4M3, (1, 16)), b, (2, 32), 0)])
    assert plan.amax_buffer().tolist() == [1.0] + [3.0] * 4
