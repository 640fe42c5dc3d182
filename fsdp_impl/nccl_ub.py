"""NCCL user-buffer registration (``nccl_ub=True``): the engine's communication buffers come from
one ``torch.cuda.MemPool`` backed by NCCL's allocator (``ncclMemAlloc``), registered with every
process group the engine communicates on, so NCCL can use its zero-copy (and, unless
``disable_symmetric_registration``, symmetric/window) kernels for them.

What lives in the pool: every buffer a collective of the engine reads or writes. The units'
weight shards (all-gather inputs), grad shards (reduce-scatter outputs), the grad staging
(reduce-scatter inputs; persistent under ``nccl_ub``, as under CUDA-graph mode), the unshard pool
(``nccl_ub`` implies ``fsdp_double_buffer``, as in Megatron-FSDP 0.6.1) and every all-gather
output (allocated in the pool at each gather; the caching allocator hands the same segments back
every step). ``zero_grad(set_to_none=True)`` zeroes the grad shards instead of freeing them (a
freed buffer would come back from outside the pool).

Registration happens once, at the end of the first sync backward, when every buffer of a step
exists: ``register`` walks the groups in the order ``registration_groups`` fixed at wrap time from
the agreed mesh (shard group, all-gather group, outer/hybrid groups, then the expert ones), so
every rank registers the same pool with the same groups in the same order; NCCL's registration
is collective per communicator, and a different order on two ranks would hang them. The order
is part of the wrap-time agreement (``agreement.agreement_items``).

On a machine without NCCL, ``nccl_ub=True`` is an error naming the backend; tests run the
bookkeeping on gloo with ``record_registrations()`` (no pool, the registrations recorded).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

_recording: list[list[tuple[int, ...]]] | None = None  # see record_registrations (test-only)


@contextlib.contextmanager
def record_registrations() -> Iterator[list[list[tuple[int, ...]]]]:
    """Test-only: let ``nccl_ub=True`` wrap on any backend; each model's registrations (the
    global ranks of each group, in order) are appended to the yielded list instead of reaching
    NCCL."""
    global _recording
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    return tuple(dist.get_process_group_ranks(group))


def registration_groups(groups: Sequence[tuple[str, dist.ProcessGroup | None]]) -> list[tuple[str, dist.ProcessGroup]]:
    """The distinct named groups (first occurrence of a rank set wins, ``None`` skipped), in the
    given order. Every rank runs the same code on the same agreed mesh, so the roles and sizes
    (what the wrap-time agreement compares) come out alike everywhere."""
    seen: list[tuple[int, ...]] = []
    out: list[tuple[str, dist.ProcessGroup]] = []
    for name, g in groups:
        if g is None:
            continue
        ranks = group_ranks(g)
        if ranks not in seen:
            seen.append(ranks)
            out.append((name, g))
    return out


def check_backend(groups: Sequence[dist.ProcessGroup]) -> None:
    """``nccl_ub=True`` needs NCCL on every group it registers with (before anything is built)."""
    if _recording is not None:
        return
    for g in groups:
        backend = str(dist.get_backend(g)).lower()
        if "nccl" not in backend:
            raise ValueError(f"nccl_ub=True (NCCL user-buffer registration of the FSDP buffers): it needs the "
                             f"NCCL backend (this process group uses {backend!r}); pass nccl_ub=False on this "
                             "backend")


def nccl_allocator(group: dist.ProcessGroup, device: torch.device) -> Any:
    """NCCL's allocator (``ncclMemAlloc``) as torch exposes it, or a clear error at wrap time.

    torch offers it only where NCCL is 2.19 or newer and the device supports multicast (driver,
    fabric and ``CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED``); elsewhere it raises "NCCL mem
    allocator is not supported in this NCCL version" (seen on a one-H200 machine whose GPU
    reports no multicast). Registering cudaMalloc memory instead would silently change what
    nccl_ub means, so this refuses."""
    backend: Any = group._get_backend(device)
    try:
        return backend.mem_allocator
    except RuntimeError as err:
        raise RuntimeError(
            f"nccl_ub=True (NCCL user-buffer registration) needs NCCL's memory allocator, which torch "
            f"refuses on {device}: {err} (torch offers it with NCCL >= 2.19 on GPUs that support "
            "multicast, see torch.cuda / ProcessGroupNCCL.supportsTensorAlloc); pass nccl_ub=False here"
        ) from err


def allocator_unavailable(group: dist.ProcessGroup, device: torch.device) -> str | None:
    """Why ``nccl_ub=True`` cannot run on ``device`` (None when it can): for tests that skip."""
    try:
        nccl_allocator(group, device)
    except RuntimeError as err:
        return str(err)
    return None


def segment_sizes(snapshot: Sequence[dict[str, Any]]) -> list[int]:
    """The pool's segment sizes in the order torch registers them (by address)."""
    return [int(seg["total_size"]) for seg in sorted(snapshot, key=lambda seg: int(seg["address"]))]


def _mib(sizes: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(f"{n / 2**20:.1f}" for n in sizes[:limit])
    return f"[{shown}{', ...' if len(sizes) > limit else ''}] MiB ({len(sizes)} segments)"


def segment_mismatch(lists: Sequence[Sequence[int]], ranks: Sequence[int]) -> str | None:
    """None when every rank's segment sizes agree with the first rank's, else what differs."""
    first = list(lists[0])
    for rank, sizes in zip(ranks[1:], lists[1:], strict=True):
        sizes = list(sizes)
        if sizes == first:
            continue
        pairs = enumerate(zip(first, sizes, strict=False))  # the lengths may differ too
        at = next((i for i, (a, b) in pairs if a != b), min(len(first), len(sizes)))
        return (f"group ranks {list(ranks)}: rank {ranks[0]} has {_mib(first)}, rank {rank} has {_mib(sizes)}; "
                f"they first differ at segment {at}")
    return None


class UserBuffers:
    """One model's NCCL memory pool and its one-time registration."""

    def __init__(self, groups: list[dist.ProcessGroup], device: torch.device, symmetric: bool) -> None:
        self.groups = groups
        self.device = device
        self.symmetric = symmetric
        self.registrations = 0  # registrations made (one per group, once)
        self.pool: torch.cuda.MemPool | None = None
        if _recording is None:
            self.pool = torch.cuda.MemPool(nccl_allocator(groups[0], device))
        self._registered = False

    @contextlib.contextmanager
    def allocating(self) -> Iterator[None]:
        """Allocations inside come from the pool (nothing changes without one)."""
        if self.pool is None:
            yield
            return
        with torch.cuda.use_mem_pool(self.pool, self.device):
            yield

    def register(self) -> None:
        """Register the pool with every group, once, in the wrap-time order."""
        if self._registered:
            return
        self._registered = True
        if self.pool is None:
            assert _recording is not None
            _recording.append([group_ranks(g) for g in self.groups])
            self.registrations = len(self.groups)
            return
        if self.symmetric:
            self._check_symmetric_segments()
        for g in self.groups:
            backend: Any = g._get_backend(self.device)  # ProcessGroupNCCL (check_backend)
            try:
                backend.register_mem_pool(self.pool, symm=self.symmetric)
            except TypeError:  # a torch whose register_mem_pool has no symmetric mode
                backend.register_mem_pool(self.pool)
            self.registrations += 1

    def _check_symmetric_segments(self) -> None:
        """Window registration needs the same segments on every rank of a group: compare first.

        Seen on 2 H200s (NCCL 2.28.9) at 1.3B: ranks whose pool segments differed failed inside
        NCCL ("Failed to window register segment", an unhandled CUDA error) and the pool's
        destructor then aborted the process. Every member gets every member's list, so all of
        them raise alike and none goes on to register alone."""
        assert self.pool is not None
        mine = segment_sizes(self.pool.snapshot())
        for g in self.groups:
            lists: list[Any] = [None] * g.size()
            dist.all_gather_object(lists, mine, group=g)
            why = segment_mismatch(lists, group_ranks(g))
            if why is not None:
                raise RuntimeError(
                    f"nccl_ub=True with symmetric (window) registration needs the same NCCL pool segments on "
                    f"every rank of a group, in the same order: {why}. Pass disable_symmetric_registration=True "
                    "(local registration) instead")

    @property
    def registered(self) -> bool:
        return self._registered
