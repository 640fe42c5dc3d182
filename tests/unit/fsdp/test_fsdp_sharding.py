"""Property tests of the pure shard arithmetic (fsdp_impl.sharding): for random shapes and world
sizes, shards cover every row exactly once in rank order, shard-then-gather is the identity
(also through the padded all-gather/reduce-scatter layout), and empty shards are handled."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_impl.sharding import FlatLayout, chunk_rows, shard_row_range

shapes = st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=3).map(tuple)
worlds = st.integers(min_value=1, max_value=9)


@given(rows=st.integers(min_value=0, max_value=100), world=worlds)
def test_row_ranges_cover_rows_exactly_once(rows: int, world: int) -> None:
    covered = []
    for rank in range(world):
        start, end = shard_row_range(rows, world, rank)
        assert 0 <= start <= end <= rows
        assert end - start <= chunk_rows(rows, world)
        covered.extend(range(start, end))
    assert covered == list(range(rows))


@given(rows=st.integers(min_value=0, max_value=60), world=worlds)
def test_row_ranges_match_torch_chunk(rows: int, world: int) -> None:
    """Same split as torch.chunk / DTensor Shard(0), padded with empty trailing shards."""
    chunks = list(torch.arange(rows).chunk(world)) if rows else []
    for rank in range(world):
        start, end = shard_row_range(rows, world, rank)
        expected = chunks[rank].tolist() if rank < len(chunks) else []
        assert list(range(start, end)) == expected


@settings(max_examples=60, deadline=None)
@given(param_shapes=st.lists(shapes.filter(lambda s: len(s) > 0), min_size=1, max_size=5), world=worlds)
def test_shard_then_gather_is_identity(param_shapes, world: int) -> None:
    layout = FlatLayout(param_shapes, world)
    fulls = [torch.randn(s) for s in param_shapes]
    # Every rank packs its local shards into its segment (what the weight buffer holds) ...
    segments = torch.zeros(world, layout.segment_numel)
    for rank in range(world):
        for i, full in enumerate(fulls):
            start, end = shard_row_range(full.shape[0], world, rank)
            view = layout.local_view(segments[rank], i, rank)
            assert view.shape == full[start:end].shape
            view.copy_(full[start:end])
    # ... the all-gather output is the rank-major concatenation, and unpacking restores the params.
    for fused in (True, False):
        outs = [torch.full_like(full, float("nan")) for full in fulls]
        layout.unpack_all(segments.reshape(-1), outs, fused=fused)
        assert all(torch.equal(out, full) for out, full in zip(outs, fulls, strict=True))


@settings(max_examples=60, deadline=None)
@given(param_shapes=st.lists(shapes.filter(lambda s: len(s) > 0), min_size=1, max_size=5), world=worlds)
def test_pack_places_each_rank_rows_in_its_segment(param_shapes, world: int) -> None:
    """pack_full (the reduce-scatter input) puts rank r's rows in segment r, padding zero."""
    layout = FlatLayout(param_shapes, world)
    buf = torch.full((layout.total_numel,), float("nan"))
    buf.zero_()
    fulls = [torch.randn(s) for s in param_shapes]
    for i, full in enumerate(fulls):
        layout.pack_full(buf, i, full)
    segments = buf.view(world, layout.segment_numel)
    for rank in range(world):
        for i, full in enumerate(fulls):
            start, end = shard_row_range(full.shape[0], world, rank)
            assert torch.equal(layout.local_view(segments[rank], i, rank), full[start:end])
    used = sum(f.numel() for f in fulls)
    assert int(torch.count_nonzero(buf)) <= used  # padding stays zero
    layout.pack_full(buf, 0, fulls[0], accumulate=True)
    assert torch.allclose(layout.local_view(segments[0], 0, 0),
                          2 * fulls[0][slice(*shard_row_range(fulls[0].shape[0], world, 0))])


@settings(max_examples=60, deadline=None)
@given(param_shapes=st.lists(shapes, min_size=1, max_size=5), world=worlds, fused=st.booleans())
def test_pack_all_matches_per_param_pack(param_shapes, world: int, fused: bool) -> None:
    """pack_all (one _chunk_cat, or one padded copy per param; casting bf16 to fp32) writes every
    element of its output, pads with zeros and puts the same values where pack_full does, empty
    params included."""
    layout = FlatLayout(param_shapes, world)
    fulls = [torch.randn(s).to(torch.bfloat16) for s in param_shapes]
    expected = torch.zeros(layout.total_numel)
    for i, full in enumerate(fulls):
        if full.numel():
            layout.pack_full(expected, i, full)
    out = torch.full((layout.total_numel,), float("nan"))  # transient buffers come from torch.empty
    layout.pack_all(out, fulls, fused=fused)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("fused", [True, False])
def test_one_shard_copies_cast_into_any_strides(fused: bool) -> None:
    """World 1 (one multi-tensor copy): unpacking an fp32 segment into bf16 params, one of them a
    transposed (non-contiguous) view and one empty, equals casting each slice; packing bf16 grads
    back into an fp32 segment restores the bf16-rounded values and touches nothing else."""
    shapes = [(3, 4), (0, 2), (5,), (4, 3)]
    layout = FlatLayout(shapes, 1)
    src = torch.randn(layout.total_numel)
    outs = [torch.full(s, float("nan"), dtype=torch.bfloat16) for s in shapes[:3]]
    outs.append(torch.full((3, 4), float("nan"), dtype=torch.bfloat16).t())
    layout.unpack_all(src, outs, fused=fused)
    offset = 0
    for out, shape in zip(outs, shapes, strict=True):
        n = out.numel()
        assert torch.equal(out, src[offset:offset + n].view(shape).to(torch.bfloat16))
        offset += n
    packed = torch.full((layout.total_numel,), float("nan"))
    layout.pack_all(packed, outs, fused=fused)
    assert torch.equal(packed, src.to(torch.bfloat16).float())


def test_empty_shards_for_param_smaller_than_world() -> None:
    layout = FlatLayout([(3,), (2, 5)], 4)
    assert layout.slots[0].chunk == 1 and layout.slots[1].chunk == 1
    assert layout.local_view(torch.zeros(layout.segment_numel), 0, 3).shape == (0,)
    assert layout.local_view(torch.zeros(layout.segment_numel), 1, 2).shape == (0, 5)
    assert layout.segment_numel == 1 + 5


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_shards"):
        chunk_rows(3, 0)
    with pytest.raises(ValueError, match="rank"):
        shard_row_range(3, 2, 2)
    with pytest.raises(ValueError, match="0-dim"):
        FlatLayout([()], 2)


def test_one_shard_plans_copy_like_the_plain_path() -> None:
    """World 1 with the plans a unit keeps: an unpack through ``unpack_plan``'s flat views and a
    pack through ``pack_plan``'s views of a fixed buffer give exactly the plain copies' values
    (casting, an empty param, two dtypes among the targets); a plan for another buffer, or grads
    not in their slots' shapes, fall back to the plain path instead of writing wrong ranges."""
    shapes = [(3, 4), (0, 2), (5,), (2, 3)]
    layout = FlatLayout(shapes, 1)
    src = torch.randn(layout.total_numel)
    dtypes = [torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    planned = [torch.full(s, float("nan"), dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
    plain = [t.clone() for t in planned]
    plan = layout.unpack_plan(planned)
    assert plan.solo is not None and sorted(len(slots) for slots, _ in plan.solo) == [1, 2]
    layout.unpack_all(src, planned, plan=plan)
    layout.unpack_all(src, plain)
    for a, b in zip(planned, plain, strict=True):
        assert torch.equal(a, b)
    # a non-contiguous target has no flat view: no plan, the plain path
    assert layout.unpack_plan([planned[0].t(), *planned[1:]]).solo is None

    grads = [torch.randn(s, dtype=torch.bfloat16) for s in shapes]
    out = torch.full((layout.total_numel,), float("nan"))
    pack = layout.pack_plan(out)
    assert pack is not None and pack.slots == [0, 2, 3]
    layout.pack_all(out, grads, plan=pack)
    expected = torch.cat([g.reshape(-1).float() for g in grads])
    assert torch.equal(out, expected)
    other = torch.full((layout.total_numel,), float("nan"))
    layout.pack_all(other, grads, plan=pack)  # the plan is for ``out``: not used
    assert torch.equal(other, expected)
    flat = [g.reshape(-1) for g in grads]  # same numel, other shapes: the views do not fit
    out.fill_(float("nan"))
    layout.pack_all(out, flat, plan=pack)
    assert torch.equal(out, expected)
    assert FlatLayout(shapes, 2).pack_plan(torch.zeros(2 * FlatLayout(shapes, 2).segment_numel)) is None
