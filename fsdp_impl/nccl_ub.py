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

Symmetric (window) registration is also collective per pool segment, so first every rank's
segment sizes are compared within each group and the verdict shared over all ranks
(``agree_on_segments``): a mismatch is one clear error everywhere, before anything is registered.

On a machine without NCCL, ``nccl_ub=True`` is an error naming the backend; tests run the
bookkeeping on gloo with ``NCCL_UB_RECORDED.on()`` (no pool, the registrations recorded).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import _testing
from .device import current

G = TypeVar("G")  # a process group (tests stand in tuples of ranks)


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
    if _testing.NCCL_UB_RECORDED.active:
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
    """The pool's segment sizes in the order torch window-registers them (by address); only the
    sizes matter to the collective, so every other field of a segment is ignored."""
    ordered = sorted(snapshot, key=lambda segment: int(segment["address"]))
    return [int(segment["total_size"]) for segment in ordered]


def _mib(sizes: Sequence[int], at: int, width: int = 6) -> str:
    """``sizes`` in MiB, cut to a window that starts just before index ``at`` (where two lists
    first differ), so a long list still shows the segments that matter."""
    start = max(0, min(at, len(sizes)) - 2)
    shown = [f"{n / 2**20:.1f}" for n in sizes[start:start + width]]
    head = ["..."] if start > 0 else []
    tail = ["..."] if start + width < len(sizes) else []
    return f"[{', '.join(head + shown + tail)}] MiB ({len(sizes)} segments)"


def segment_mismatch(lists: Sequence[Sequence[int]], ranks: Sequence[int]) -> str | None:
    """None when every member's segment sizes equal the first member's; else the first member
    that differs, both lists and the first differing index (the lengths may differ too)."""
    first = list(lists[0])
    for rank, sizes in zip(ranks[1:], lists[1:], strict=True):
        other = list(sizes)
        if other == first:
            continue
        common = min(len(first), len(other))
        at = next((i for i in range(common) if first[i] != other[i]), common)
        return (f"group ranks {list(ranks)} have segment sizes: rank {ranks[0]} has {_mib(first, at)} vs rank {rank} "
                f"has {_mib(other, at)}, first differing at segment {at}")
    return None


def agree_on_segments(mine: list[int], groups: Sequence[G], ranks_of: Callable[[G], Sequence[int]],
                      gather: Callable[[Any, G], list[Any]], everyone: G) -> str | None:
    """Compare this rank's segment sizes within each group, then share the verdicts over
    ``everyone``: the first mismatch any rank found, the same on every rank, or None.

    Every rank makes every gather (no early exit: a rank that stopped would leave the members of
    its later groups waiting). A group's members only see that group, so a rank whose own groups
    all agree could otherwise go on to register with a peer that raises; the final gather over all
    ranks (the wrap-time agreement already gathers over them) makes the decision one."""
    why: str | None = None
    for g in groups:
        found = segment_mismatch(gather(mine, g), ranks_of(g))
        why = why if why is not None else found
    return next((verdict for verdict in gather(why, everyone) if verdict is not None), None)


class UserBuffers:
    """One model's NCCL memory pool and its one-time registration."""

    def __init__(self, groups: list[dist.ProcessGroup], device: torch.device, symmetric: bool) -> None:
        self.groups = groups
        self.device = device
        self.symmetric = symmetric
        self.registrations = 0  # registrations made (one per group, once)
        self.pool: torch.cuda.MemPool | None = None
        if not _testing.NCCL_UB_RECORDED.active:
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
            recording = _testing.NCCL_UB_RECORDED.value
            assert recording is not None
            recording.append([group_ranks(g) for g in self.groups])
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
        """Window registration is collective per segment: every rank of a group must hold the same
        segments. Seen on 2 H200s (NCCL 2.28.9) at 1.3B: the ranks' pool segments differed, NCCL
        failed ("Failed to window register segment", unhandled cuda error) and the pool's
        destructor then aborted the process. Checked first, so nothing is registered on a mismatch."""
        assert self.pool is not None

        def gather(obj: Any, g: dist.ProcessGroup) -> list[Any]:
            out: list[Any] = [None] * g.size()
            dist.all_gather_object(out, obj, group=g)
            return out

        world = dist.group.WORLD  # as check_ranks_agree: every rank of the world wraps the model
        assert world is not None
        # all_gather_object on NCCL sends from the current CUDA device: make it this model's
        with current(self.device):
            why = agree_on_segments(segment_sizes(self.pool.snapshot()), self.groups, group_ranks, gather, world)
        if why is not None:
            raise RuntimeError(
                f"nccl_ub=True with symmetric (window) registration needs the same NCCL pool segments on every "
                f"rank of a group: {why}; pass disable_symmetric_registration=True (local registration) instead")

    @property
    def registered(self) -> bool:
        return self._registered
