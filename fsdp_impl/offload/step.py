"""The streamed optimizer step of ``OffloadPolicy(step="gpu")``: host state through a device window.

The state that lives in host memory (main params, optimizer moments, maybe grads) is cut into
chunks of at most ``capacity`` elements (``plan_chunks``); the window holds ``WINDOW_SLOTS``
chunks (fewer when the step has fewer; a chunk is never larger than all the step streams, so an
oversized ``chunk_bytes`` allocates no more than that: ``window_capacity``). Per chunk ``i``
(slot ``i % WINDOW_SLOTS``):

1. **H2D** on the h2d stream: copy the chunk's host pieces into its slot, after the D2H of the
   chunk that used the slot before (``i - WINDOW_SLOTS``) is done;
2. **step** on the compute stream, after that H2D: the optimizer's own update math on the
   slot's views (and the new weights cast into the device compute shard);
3. **D2H** on the d2h stream, after that step: copy the updated params and moments back.

So H2D of chunk ``i+1``, the math of ``i`` and D2H of ``i-1`` overlap. At the end the compute
stream waits for the last D2H and the host waits for it too (host code may read the params or
the state right after ``optimizer.step()``). Adam is elementwise, so cutting a parameter into
pieces changes nothing about its result as long as the kernels see the same element positions
relative to their vector width: pieces start at multiples of ``ALIGN`` elements of their
parameter (CPU kernels handle a tensor's tail element by element; CUDA kernels do not care).

The streams are ``device.CommStream`` objects (no-ops on CPU); ``StreamLog`` records the same
calls as a sequence, so the ordering above is testable on a CPU-only machine.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch.profiler import record_function

from ..device import CommStream, free_memory, wait_on_host

ALIGN = 128  # elements: a piece of a parameter starts at a multiple of this from the param's start
WINDOW_SLOTS = 3  # chunks resident in the device window: H2D, math and D2H overlap
# The kinds of flat tensor a step entry holds, each streamed through the window or used in place
ChunkKind = Literal["param", "grad", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"]
PARAM: ChunkKind = "param"
GRAD: ChunkKind = "grad"
STATE_KINDS: tuple[ChunkKind, ...] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # Adam's state, in this order
WRITE_BACK: tuple[ChunkKind, ...] = (PARAM, *STATE_KINDS)  # kinds the step updates
# What the pipeline does to a chunk, in order (the ops a recorded ``StreamLog`` holds)
ChunkOp = Literal["h2d", "step", "d2h"]


def window_capacity(chunk_bytes: int, per_elem: int, total_numel: int) -> int:
    """Elements per chunk: ``chunk_bytes`` over the streamed bytes per element, at least
    ``ALIGN``, and never more than the step streams (``total_numel``): a larger chunk only holds
    window memory nothing is copied into. The plan is the same either way (everything in one
    chunk), so the clamp changes no copy and no number."""
    return max(ALIGN, min(chunk_bytes // max(per_elem, 1), total_numel))


def window_too_large(chunk_bytes: int, needed: int, limit: int, device: torch.device,
                     rank: int | None = None) -> ValueError:
    """The error for a streaming window that cannot fit: it names the field, both sizes and
    what to do (the step would otherwise die in the allocator, naming neither)."""
    where = f" on rank {rank}" if rank is not None else ""
    memory = "host memory" if device.type == "cpu" else f"{device} memory"
    return ValueError(f"OffloadPolicy.chunk_bytes={chunk_bytes} needs a streaming window of {needed} bytes "
                      f"({needed / 2**30:.2f} GiB: up to {WINDOW_SLOTS} chunks, each at most the state the step "
                      f"streams), but only {limit} bytes ({limit / 2**30:.2f} GiB) of {memory} are free{where}; "
                      "pass a smaller OffloadPolicy.chunk_bytes")


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of entry ``entry``'s flat local tensors, at ``offset`` of its
    chunk's window slot."""

    entry: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def plan_chunks(numels: Sequence[int], capacity: int, align: int = ALIGN) -> list[list[Piece]]:
    """Pack tensors of ``numels`` elements, in order, into chunks of at most ``capacity``
    elements; a tensor that does not fit the rest of a chunk is split at a multiple of ``align``
    elements from its start (or moved to the next chunk when less than ``align`` is left).
    Empty tensors get no piece. Needs ``capacity >= align``."""
    if capacity < align:
        raise ValueError(f"chunk capacity {capacity} is smaller than the alignment {align}")
    chunks: list[list[Piece]] = []
    current: list[Piece] = []
    used = 0
    for index, numel in enumerate(numels):
        pos = 0
        while pos < numel:
            room = capacity - used
            take = numel - pos if numel - pos <= room else room // align * align
            if take == 0:
                chunks.append(current)
                current, used = [], 0
                continue
            current.append(Piece(index, pos, pos + take, used))
            used += take
            pos += take
            if used == capacity:
                chunks.append(current)
                current, used = [], 0
    if current:
        chunks.append(current)
    return chunks


@dataclass
class StreamEntry:
    """One parameter of the step: its flat local tensors by kind (``param``, ``grad``,
    ``exp_avg``, ...), its param-group index, and where the new weights also go (the flat slice
    of the device compute shard, or None)."""

    group: int
    tensors: dict[ChunkKind, torch.Tensor]
    compute: torch.Tensor | None = None
    extra: Any = None  # what the kernel needs besides the tensors (e.g. the step counter)

    @property
    def numel(self) -> int:
        return self.tensors[PARAM].numel()


# The device window: one tensor of ``slots`` chunks per streamed (kind, dtype)
Window = dict[tuple[ChunkKind, torch.dtype], torch.Tensor]

# A kernel updates the pieces of one param group in one chunk: (group index, [(entry, views)]).
Kernel = Callable[[int, list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]]], None]


class Stream(Protocol):
    """What the pipeline needs from a side stream (``device.CommStream`` has it)."""

    def use(self) -> contextlib.AbstractContextManager[None]: ...
    def record(self) -> Any: ...
    def wait(self, event: Any) -> None: ...


@dataclass
class StreamLog:
    """Test double for the streams: ``events`` records, in program order, ``("op", what, chunk,
    stream)`` for the pipeline's copies and math, ``("record", token, stream)``, ``("wait", token,
    stream)`` (``stream`` waits for ``token``; entering a side stream waits for the compute stream,
    recorded as token ``("compute", None)``) and ``("host_wait", token)``."""

    events: list[tuple] = field(default_factory=list)
    _current: list[str] = field(default_factory=lambda: ["compute"])

    def stream(self, name: str) -> RecordingStream:
        return RecordingStream(name, self)

    def op(self, what: ChunkOp, chunk: int) -> None:
        self.events.append(("op", what, chunk, self._current[-1]))


class RecordingStream:
    """A side stream that only records what was asked of it (see ``StreamLog``)."""

    def __init__(self, name: str, log: StreamLog) -> None:
        self.name = name
        self.log = log
        self._count = 0

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        self.log.events.append(("wait", ("compute", None), self.name))  # as CommStream.use does
        self.log._current.append(self.name)
        try:
            yield
        finally:
            self.log._current.pop()

    def record(self) -> tuple[str, int]:
        token = (self.name, self._count)
        self._count += 1
        self.log.events.append(("record", token, self.name))
        return token

    def wait(self, event: Any) -> None:
        self.log.events.append(("wait", event, self.log._current[-1]))


@dataclass
class StepStreams:
    """The streamed step's two side streams, and the log when they are recording ones."""

    h2d: Stream
    d2h: Stream
    log: StreamLog | None = None

    @classmethod
    def for_device(cls, device: torch.device, side: bool = True) -> StepStreams:
        return cls(CommStream(device, side), CommStream(device, side))

    @classmethod
    def recording(cls) -> StepStreams:
        log = StreamLog()
        return cls(log.stream("h2d"), log.stream("d2h"), log)

    def op(self, what: ChunkOp, chunk: int) -> None:
        if self.log is not None:
            self.log.op(what, chunk)

    def host_wait(self, event: Any) -> None:
        if self.log is not None:
            self.log.events.append(("host_wait", event))
        elif event is not None:
            wait_on_host(event)


@dataclass(frozen=True)
class _Run:
    """A coalesced copy: ``numel`` elements of ``src`` (a flat view) at window ``offset``."""

    src: torch.Tensor
    offset: int
    numel: int


def _coalesce(sources: list[tuple[torch.Tensor, int]]) -> list[_Run]:
    """Merge pieces that are adjacent both in their source storage and in the window (a unit's
    consecutive params in its flat buffer become one copy per chunk)."""
    runs: list[_Run] = []
    for src, offset in sources:
        if runs:
            last = runs[-1]
            if (last.src.dtype == src.dtype and last.offset + last.numel == offset
                    and last.src.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
                    and last.src.data_ptr() + last.numel * src.element_size() == src.data_ptr()):
                merged = torch.as_strided(last.src, (last.numel + src.numel(),), (1,), last.src.storage_offset())
                runs[-1] = _Run(merged, last.offset, last.numel + src.numel())
                continue
        runs.append(_Run(src, offset, src.numel()))
    return runs


class StreamedStep:
    """Runs one optimizer step over host-resident tensors through a device window.

    ``streamed``: the kinds held in host memory (copied in; those in ``WRITE_BACK`` copied back);
    other kinds are used in place. ``chunk_bytes`` bounds one chunk's window bytes; the window
    holds ``min(slots, chunks)`` chunks of at most what the step streams (``window_capacity``),
    and one that cannot fit the free memory of ``device`` is refused before it is allocated."""

    def __init__(self, device: torch.device, streamed: set[ChunkKind], chunk_bytes: int, non_blocking: bool,
                 streams: StepStreams, slots: int = WINDOW_SLOTS) -> None:
        self.device = device
        self.streamed = streamed
        self.chunk_bytes = chunk_bytes
        self.non_blocking = non_blocking
        self.streams = streams
        self.slots = slots
        self.last_plan: list[list[Piece]] = []  # for tests and logs
        self.last_window_bytes = 0  # bytes of the last step's window (for tests and logs)
        self._fits = 0  # the largest window found to fit the free memory so far

    def capacity(self, entries: list[StreamEntry]) -> int:
        """Elements per chunk: ``chunk_bytes`` over the widest entry's streamed bytes per element."""
        per_elem = max((sum(t.element_size() for k, t in e.tensors.items() if k in self.streamed)
                        for e in entries), default=0)
        return window_capacity(self.chunk_bytes, per_elem, sum(e.numel for e in entries))

    def run(self, entries: list[StreamEntry], kernel: Kernel) -> None:
        """The pipelined step over ``entries`` (see the module docstring)."""
        if not entries:
            return
        capacity = self.capacity(entries)
        chunks = plan_chunks([e.numel for e in entries], capacity)
        self.last_plan = chunks
        window = self._window(entries, capacity, min(self.slots, len(chunks)))
        h2d_done: dict[int, Any] = {}
        d2h_done: dict[int, Any] = {}
        with record_function("FSDP::offload_step"):
            for i in range(min(self.slots, len(chunks))):
                h2d_done[i] = self._load(i, chunks, entries, window, capacity, d2h_done)
            for i, chunk in enumerate(chunks):
                self.streams.h2d.wait(h2d_done.pop(i))  # the compute stream waits for the chunk's H2D
                self.streams.op("step", i)
                self._compute(chunk, entries, window, (i % self.slots) * capacity, kernel)
                with self.streams.d2h.use():  # after the chunk's math (use() waits for compute)
                    self.streams.op("d2h", i)
                    self._copy(chunk, entries, window, (i % self.slots) * capacity, to_host=True)
                    d2h_done[i] = self.streams.d2h.record()
                if i + self.slots < len(chunks):
                    h2d_done[i + self.slots] = self._load(i + self.slots, chunks, entries, window, capacity,
                                                          d2h_done)
            if chunks:
                last = d2h_done[len(chunks) - 1]
                self.streams.d2h.wait(last)  # the compute stream: the window is free, host copies done
                self.streams.host_wait(last)  # host code may read the params/state right after step()

    def _window(self, entries: list[StreamEntry], capacity: int, slots: int) -> Window:
        """One device tensor of ``slots`` chunks per streamed (kind, dtype), on the compute stream
        (freed when the step returns: the compute stream has waited for every use by then).
        Chunk ``i`` uses slot ``i % self.slots``, so fewer chunks than slots need only as many."""
        keys = sorted({(k, t.dtype) for e in entries for k, t in e.tensors.items() if k in self.streamed}, key=str)
        needed = sum(slots * capacity * dtype.itemsize for _, dtype in keys)
        if needed > self._fits:  # checked once per size: the step's host path stays as it was
            limit = free_memory(self.device)
            if limit is not None and needed > limit:
                raise window_too_large(self.chunk_bytes, needed, limit, self.device)
            self._fits = needed
        self.last_window_bytes = needed
        return {key: torch.empty(slots * capacity, dtype=key[1], device=self.device) for key in keys}

    def _load(self, i: int, chunks: list[list[Piece]], entries: list[StreamEntry],
              window: Window, capacity: int, d2h_done: dict[int, Any]) -> Any:
        with self.streams.h2d.use():
            if i - self.slots in d2h_done:  # the slot's previous chunk must be back on the host
                self.streams.h2d.wait(d2h_done.pop(i - self.slots))
            self.streams.op("h2d", i)
            self._copy(chunks[i], entries, window, (i % self.slots) * capacity, to_host=False)
            return self.streams.h2d.record()

    def _copy(self, chunk: list[Piece], entries: list[StreamEntry], window: Window, base: int, to_host: bool) -> None:
        """Copy the chunk's streamed kinds host -> slot (all of them) or slot -> host (the
        updated ones), one copy per coalesced run."""
        kinds = sorted({k for p in chunk for k in entries[p.entry].tensors if k in self.streamed})
        for kind in kinds:
            if to_host and kind not in WRITE_BACK:
                continue
            sources = [(entries[p.entry].tensors[kind][p.start:p.stop], p.offset) for p in chunk
                       if kind in entries[p.entry].tensors]
            for run in _coalesce(sources):
                slot = window[(kind, run.src.dtype)][base + run.offset: base + run.offset + run.numel]
                if to_host:
                    run.src.copy_(slot, non_blocking=self.non_blocking)
                else:
                    slot.copy_(run.src, non_blocking=self.non_blocking)

    def _compute(self, chunk: list[Piece], entries: list[StreamEntry], window: Window, base: int,
                 kernel: Kernel) -> None:
        """The kernel on the chunk's views, one call per param group (in group order), then the
        new weights cast into the device compute shards."""
        by_group: dict[int, list[tuple[Piece, dict[ChunkKind, torch.Tensor]]]] = {}
        for p in chunk:
            views = {}
            for kind, tensor in entries[p.entry].tensors.items():
                if kind in self.streamed:
                    views[kind] = window[(kind, tensor.dtype)][base + p.offset: base + p.offset + p.numel]
                else:
                    views[kind] = tensor[p.start:p.stop]
            by_group.setdefault(entries[p.entry].group, []).append((p, views))
        for group in sorted(by_group):
            items = by_group[group]
            kernel(group, [(entries[p.entry], views) for p, views in items])
            for p, views in items:
                compute = entries[p.entry].compute
                if compute is not None:
                    compute[p.start:p.stop].copy_(views[PARAM])
