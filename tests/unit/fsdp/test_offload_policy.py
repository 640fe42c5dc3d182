"""CPU offload pieces without a process group: ``OffloadPolicy`` validation, the wrap-time and
optimizer checks, the chunk planning arithmetic of the streamed step, and its stream order.

The streamed step runs here with its "device window" in host memory and ``StepStreams.recording()``
in place of the CUDA side streams, so the order of copies, math and waits (which on a GPU is
enforced by events) is checked as a recorded sequence.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim.adam import adam

import fsdp_impl
from fsdp_impl._testing import STREAMED_STEP_ON_CPU
from fsdp_impl.offload.host import MIN_CHUNK_BYTES, OffloadPolicy, check_offload
from fsdp_impl.offload.optim import check_offload_optimizer
from fsdp_impl.offload.step import ALIGN, StepStreams, StreamedStep, StreamEntry, _coalesce, plan_chunks

CPU = torch.device("cpu")


# ----------------------------------------------------------------------------------- policy
@pytest.mark.parametrize("field,value", [("optimizer_state", 1), ("main_params", "yes"), ("params", None),
                                         ("pin_memory", 0), ("grads", "host")])
def test_non_bool_fields_name_the_field(field: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"OffloadPolicy\.{field} must be"):
        OffloadPolicy(**{field: value})


@pytest.mark.parametrize("value", ["GPU", "host", None, 1])
def test_step_names_its_allowed_values(value: object) -> None:
    with pytest.raises(ValueError, match=r"OffloadPolicy\.step must be one of \('gpu', 'cpu'\)"):
        OffloadPolicy(step=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value,error", [(True, TypeError), (1.5, TypeError), (MIN_CHUNK_BYTES - 1, ValueError),
                                         (0, ValueError)])
def test_chunk_bytes_is_an_int_of_at_least_the_minimum(value: object, error: type) -> None:
    with pytest.raises(error, match=r"OffloadPolicy\.chunk_bytes must be"):
        OffloadPolicy(chunk_bytes=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs,match", [
    (dict(step="cpu", main_params=False), "main_params and optimizer_state must be True"),
    (dict(step="cpu", optimizer_state=False), "main_params and optimizer_state must be True"),
    (dict(step="cpu", grads=False), "grads must be None or True"),
    (dict(step="cpu", grads=False, main_params=True), "grads must be None or True"),
    (dict(grads=False), "requires .grad on its parameter's device"),
    (dict(params=True, main_params=False), "params=True gathers from the host main-parameter shards"),
    (dict(optimizer_state=False, main_params=False), "offloads nothing"),
])
def test_inconsistent_combinations_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OffloadPolicy(**kwargs)


def test_defaults_and_resolved_grads() -> None:
    policy = OffloadPolicy()
    assert (policy.step, policy.optimizer_state, policy.main_params, policy.params) == ("gpu", True, True, False)
    # host main params take host grads (torch: .grad on the param's device); device ones keep them
    assert policy.grads_on_host is True and policy.device_compute_shard
    assert OffloadPolicy(main_params=False).grads_on_host is False
    assert OffloadPolicy(step="cpu").grads_on_host is True
    assert OffloadPolicy(grads=True).grads_on_host is True
    assert OffloadPolicy(params=True).device_compute_shard is False
    assert OffloadPolicy(optimizer_state=False, main_params=False, grads=True).grads_on_host
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.step = "cpu"  # type: ignore[misc]
    assert fsdp_impl.OffloadPolicy is OffloadPolicy


# ------------------------------------------------------------------------ wrap-time checks
def test_wrap_time_errors_name_the_field() -> None:
    module = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="offload_policy must be a fsdp_impl.OffloadPolicy or None"):
        check_offload("cpu", CPU, False, module)
    with pytest.raises(ValueError, match=r"offload_policy\.step='gpu' streams .* CUDA device.*'cpu'"):
        check_offload(OffloadPolicy(pin_memory=False), CPU, False, module)
    with pytest.raises(ValueError, match=r"offload_policy\.pin_memory=True needs page-locked host memory"):
        check_offload(OffloadPolicy(step="cpu"), CPU, False, module)
    with pytest.raises(ValueError, match="offload_policy cannot be combined with cuda_graph_mode=True"):
        check_offload(OffloadPolicy(step="cpu", pin_memory=False), CPU, True, module)
    check_offload(OffloadPolicy(step="cpu", pin_memory=False), CPU, False, module)
    check_offload(None, CPU, True, module)
    with STREAMED_STEP_ON_CPU.on():
        check_offload(OffloadPolicy(pin_memory=False), CPU, False, module)


def test_streamed_step_takes_adam_and_adamw_only() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    gpu = OffloadPolicy(pin_memory=False)
    for ok in (torch.optim.Adam(params), torch.optim.AdamW(params), fsdp_impl.optim.Adam(params),
               fsdp_impl.optim.AdamW(params)):
        check_offload_optimizer(gpu, ok)

    class MyAdam(torch.optim.Adam):
        pass

    for bad, name in ((torch.optim.SGD(params, lr=0.1), "torch.optim.sgd.SGD"), (MyAdam(params), "MyAdam")):
        with pytest.raises(ValueError, match=rf"offload_policy=OffloadPolicy\(step='gpu'\).*{name}.*step='cpu'"):
            check_offload_optimizer(gpu, bad)
    check_offload_optimizer(OffloadPolicy(step="cpu", pin_memory=False), torch.optim.SGD(params, lr=0.1))
    with pytest.raises(ValueError, match="differentiable=True"):
        check_offload_optimizer(gpu, torch.optim.Adam(params, differentiable=True))


# ------------------------------------------------------------------------ chunk planning
def _check_plan(numels: list[int], capacity: int, align: int) -> None:
    chunks = plan_chunks(numels, capacity, align)
    covered: dict[int, list[tuple[int, int]]] = {}
    for chunk in chunks:
        assert chunk, "no empty chunk"
        used = 0
        for piece in chunk:
            assert piece.offset == used, "pieces are packed densely in the window slot"
            assert piece.numel > 0
            assert piece.start % align == 0, "a piece starts at a multiple of the alignment of its tensor"
            used += piece.numel
            covered.setdefault(piece.entry, []).append((piece.start, piece.stop))
        assert used <= capacity
    for index, numel in enumerate(numels):
        ranges = covered.get(index, [])
        assert [r for r in ranges] == sorted(ranges)
        flat = [i for start, stop in ranges for i in range(start, stop)]
        assert flat == list(range(numel)), f"tensor {index} is covered exactly once, in order"
    order = [p.entry for chunk in chunks for p in chunk]
    assert order == sorted(order), "tensors keep their order"


@settings(max_examples=200, deadline=None)
@given(numels=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=12),
       capacity=st.integers(min_value=16, max_value=2000), align=st.sampled_from([1, 8, 16]))
def test_plan_covers_every_element_once_within_capacity(numels: list[int], capacity: int, align: int) -> None:
    _check_plan(numels, capacity, align)


def test_plan_examples() -> None:
    # 300 + 500 into chunks of 512 aligned at 128: the second tensor is split at 128 (212 left in
    # the first chunk: room // 128 * 128), the rest (372) goes into the next chunk.
    chunks = plan_chunks([300, 500], 512, 128)
    assert [[(p.entry, p.start, p.stop, p.offset) for p in c] for c in chunks] == [
        [(0, 0, 300, 0), (1, 0, 128, 300)], [(1, 128, 500, 0)]]
    # less than one alignment left: the next tensor starts a new chunk
    assert [[(p.entry, p.start, p.stop) for p in c] for c in plan_chunks([500, 300], 512, 128)] == [
        [(0, 0, 500)], [(1, 0, 300)]]
    # a large tensor alone: full chunks, the tail in the last one; empty tensors get no piece
    assert [[(p.start, p.stop) for p in c] for c in plan_chunks([0, 1000, 0], 256, 128)] == [
        [(0, 256)], [(256, 512)], [(512, 768)], [(768, 1000)]]
    with pytest.raises(ValueError, match="smaller than the alignment"):
        plan_chunks([10], 64, 128)


def test_coalesce_merges_neighbours_in_one_storage_only() -> None:
    flat, other = torch.zeros(100), torch.zeros(100)
    runs = _coalesce([(flat[0:10], 0), (flat[10:30], 10), (flat[40:50], 30), (other[50:60], 40)])
    assert [(r.offset, r.numel, r.src.data_ptr() - flat.data_ptr()) for r in runs[:2]] == [(0, 30, 0), (30, 10, 160)]
    assert len(runs) == 3 and runs[2].src.data_ptr() == other[50:].data_ptr()


# ---------------------------------------------------------------------- the streamed step
def _entries(numels: list[int], seed: int = 0) -> tuple[list[StreamEntry], dict[str, torch.Tensor]]:
    """Entries over flat "host" buffers, one per kind, as the offloaded units keep them."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(numels)
    flats = {k: torch.randn(total, generator=gen) for k in ("param", "grad", "exp_avg")}
    flats["exp_avg_sq"] = torch.rand(total, generator=gen)
    entries, offset = [], 0
    for numel in numels:
        entries.append(StreamEntry(0, {k: f[offset:offset + numel] for k, f in flats.items()},
                                   extra={"step": torch.tensor(3.0)}))
        offset += numel
    return entries, flats


def _adam_kernel(group: int, items: list) -> None:
    adam([v["param"] for _, v in items], [v["grad"] for _, v in items], [v["exp_avg"] for _, v in items],
         [v["exp_avg_sq"] for _, v in items], [], [e.extra["step"].clone() for e, _ in items], amsgrad=False,
         beta1=0.9, beta2=0.999, lr=1e-2, weight_decay=0.01, eps=1e-8, maximize=False, foreach=False,
         decoupled_weight_decay=True)


NUMELS = [700, 5, 0, 1300, 256, 900]  # bytes per element streamed: 4 kinds x 4 = 16
CHUNK_BYTES = 512 * 16  # 512 elements per chunk


def _unchunked(entries: list[StreamEntry], flats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference: the kernel over every whole tensor (what the non-offloaded step does)."""
    expected = {k: f.clone() for k, f in flats.items()}
    views, offset = [], 0
    for entry in entries:
        n = entry.numel
        views.append((entry, {k: v[offset:offset + n] for k, v in expected.items()}))
        offset += n
    _adam_kernel(0, views)
    return expected


def test_streamed_step_equals_the_whole_tensor_step() -> None:
    """Bit for bit: each element sees the same kernel at the same position modulo ALIGN."""
    entries, flats = _entries(NUMELS)
    expected = _unchunked(entries, flats)
    step = StreamedStep(CPU, {"param", "grad", "exp_avg", "exp_avg_sq"}, CHUNK_BYTES, False, StepStreams.recording())
    step.run(entries, _adam_kernel)
    assert len(step.last_plan) == 7  # 4061 elements, 512 per chunk, split points aligned
    for kind in ("param", "exp_avg", "exp_avg_sq", "grad"):
        assert torch.equal(flats[kind], expected[kind]), f"{kind} differs from the unchunked step"


def test_resident_kinds_are_used_in_place() -> None:
    """Kinds not offloaded (here the grads) are read where they are; only streamed kinds move."""
    entries, flats = _entries(NUMELS, seed=1)
    expected = _unchunked(entries, flats)
    streams = StepStreams.recording()
    StreamedStep(CPU, {"param", "exp_avg", "exp_avg_sq"}, 512 * 12, False, streams).run(entries, _adam_kernel)
    assert all(torch.equal(flats[k], expected[k]) for k in flats)


def test_stream_order_is_recorded_h2d_then_step_then_d2h() -> None:
    """Per chunk i: H2D on the h2d stream, the math on the compute stream after waiting for that
    H2D, D2H on the d2h stream after the math (entering it waits for compute); the H2D of chunk
    i + WINDOW_SLOTS waits for the D2H of chunk i (the slot's previous user); at the end the
    compute stream and the host wait for the last D2H."""
    entries, _ = _entries(NUMELS)
    streams = StepStreams.recording()
    step = StreamedStep(CPU, {"param", "grad", "exp_avg", "exp_avg_sq"}, CHUNK_BYTES, False, streams)
    step.run(entries, _adam_kernel)
    assert streams.log is not None
    events = streams.log.events
    n, slots = len(step.last_plan), step.slots
    position = {(e[1], e[2]): i for i, e in enumerate(events) if e[0] == "op"}
    assert sorted(position) == sorted((op, c) for c in range(n) for op in ("h2d", "step", "d2h"))
    for _, op, _, stream in (e for e in events if e[0] == "op"):
        assert stream == {"h2d": "h2d", "step": "compute", "d2h": "d2h"}[op]
    token: dict[tuple[str, int], tuple] = {}  # (op, chunk) -> the event its stream recorded right after it
    for (op, chunk), i in position.items():
        if op != "step":
            token[(op, chunk)] = next(e[1] for e in events[i:] if e[0] == "record" and e[2] == op)

    def waits(what: tuple, stream: str) -> list[int]:
        return [i for i, e in enumerate(events) if e == ("wait", what, stream)]

    for c in range(n):
        h2d, stp, d2h = position[("h2d", c)], position[("step", c)], position[("d2h", c)]
        assert h2d < stp < d2h
        assert any(h2d < i < stp for i in waits(token[("h2d", c)], "compute")), f"chunk {c}: math before its H2D"
        assert any(stp < i < d2h for i in waits(("compute", None), "d2h")), f"chunk {c}: D2H not after the math"
        if c >= slots:
            free = waits(token[("d2h", c - slots)], "h2d")
            assert any(position[("d2h", c - slots)] < i < h2d for i in free), (
                f"chunk {c}: its H2D must wait for the D2H of chunk {c - slots} (same window slot)")
    last = token[("d2h", n - 1)]
    assert events[-2:] == [("wait", last, "compute"), ("host_wait", last)]
    assert max(position[("h2d", c)] for c in range(min(slots, n))) < position[("step", 0)], (
        "the first WINDOW_SLOTS chunks are loaded before the first math: H2D overlaps the math")


def test_capacity_follows_the_streamed_bytes_per_element() -> None:
    entries, _ = _entries([10_000])
    bf16 = StreamEntry(0, {"param": torch.zeros(4000), "exp_avg": torch.zeros(4000, dtype=torch.bfloat16)})
    assert StreamedStep(CPU, {"param", "exp_avg"}, 6000, False, StepStreams.recording()).capacity([bf16]) == 1000
    assert StreamedStep(CPU, {"param"}, 4096, False, StepStreams.recording()).capacity(entries) == 1024
    assert StreamedStep(CPU, {"param", "grad", "exp_avg", "exp_avg_sq"}, MIN_CHUNK_BYTES, False,
                        StepStreams.recording()).capacity(entries) == max(ALIGN, MIN_CHUNK_BYTES // 16)


def test_capacity_is_at_most_what_the_step_streams() -> None:
    """A chunk larger than all the step's elements would only hold window memory nothing is
    copied into: capacity stops at the step's element count (and never goes below ALIGN)."""
    entries, _ = _entries(NUMELS)
    assert StreamedStep(CPU, {"param"}, 2**50, False, StepStreams.recording()).capacity(entries) == sum(NUMELS)
    tiny, _ = _entries([5, 7])
    assert StreamedStep(CPU, {"param"}, 2**50, False, StepStreams.recording()).capacity(tiny) == ALIGN


KINDS = {"param", "grad", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("chunk_bytes,chunks,slots", [(2**50, 1, 1), (2**40, 1, 1), (2200 * 16, 2, 2),
                                                      (CHUNK_BYTES, 7, 3)])
def test_window_holds_only_the_chunks_the_step_has(chunk_bytes: int, chunks: int, slots: int) -> None:
    """OffloadPolicy(chunk_bytes=2**50) made the first step allocate 3 x 2**50 bytes (torch's
    allocator error, naming neither the field nor offload). The window now holds min(3, chunks)
    chunks of at most the step's elements; the plan, and so every number, is the one an exact
    chunk size gives: bit-identical to the unchunked step."""
    entries, flats = _entries(NUMELS)
    expected = _unchunked(entries, flats)
    step = StreamedStep(CPU, KINDS, chunk_bytes, False, StepStreams.recording())
    step.run(entries, _adam_kernel)
    capacity = step.capacity(entries)
    assert len(step.last_plan) == chunks
    assert step.last_window_bytes == slots * capacity * 16, "4 streamed fp32 kinds: 16 bytes per element"
    assert step.last_window_bytes <= 3 * chunk_bytes
    for kind in KINDS:
        assert torch.equal(flats[kind], expected[kind]), f"{kind} differs from the unchunked step"


def test_window_that_cannot_fit_is_refused_before_it_is_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact window is checked against the device's free memory once, before the first
    allocation: the error names OffloadPolicy.chunk_bytes, the bytes needed and the bytes free,
    and nothing was copied or stepped."""
    import fsdp_impl.offload.step as offload_step
    entries, flats = _entries(NUMELS)
    before = {k: f.clone() for k, f in flats.items()}
    needed = 3 * 512 * 16  # CHUNK_BYTES = 512 elements x 16 bytes, 7 chunks: all 3 slots
    monkeypatch.setattr(offload_step, "free_memory", lambda device: needed - 1)
    step = StreamedStep(CPU, KINDS, CHUNK_BYTES, False, StepStreams.recording())
    with pytest.raises(ValueError, match=rf"^OffloadPolicy\.chunk_bytes={CHUNK_BYTES} needs a streaming window of "
                                         rf"{needed} bytes .* but only {needed - 1} bytes .* of host memory are free; "
                                         r"pass a smaller OffloadPolicy\.chunk_bytes$"):
        step.run(entries, _adam_kernel)
    assert all(torch.equal(flats[k], before[k]) for k in flats), "a refused step must not touch the state"
    monkeypatch.setattr(offload_step, "free_memory", lambda device: needed)
    step.run(entries, _adam_kernel)  # exactly enough: runs
    assert step.last_window_bytes == needed


def test_free_memory_of_the_host_is_a_plausible_figure() -> None:
    """The limit the window is checked against: positive and at most the machine's RAM."""
    import os

    from fsdp_impl.device import free_memory
    free = free_memory(CPU)
    assert free is not None and 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert free_memory(torch.device("meta")) is None
