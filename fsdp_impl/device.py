"""The one place that picks the compute device, plus a stream abstraction that is a no-op on CPU.

On CUDA, collectives run on side streams ordered against the compute stream with events; on CPU
(gloo) everything is synchronous and these objects do nothing, so the engine code is identical.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import os
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


def pick_device(mesh: DeviceMesh) -> torch.device:
    """cuda:<current> when the mesh lives on CUDA, else cpu."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_device(device: object, mesh: DeviceMesh) -> torch.device:
    """``device`` (fully_shard's argument) checked against the mesh: it must be of the mesh's
    device type; ``None`` or an index-less device means the current device of that type."""
    default = pick_device(mesh)
    if device is None:
        return default
    try:
        resolved = torch.device(device)  # type: ignore[call-overload]
    except (TypeError, RuntimeError) as err:
        raise TypeError(f"device must be a torch.device, a device string or None, got {device!r}") from err
    if resolved.type != default.type:
        raise ValueError(f"device={str(resolved)!r} does not match the device mesh, whose device type is "
                         f"{mesh.device_type!r}; allowed values: None or a {mesh.device_type!r} device "
                         f"(e.g. {str(default)!r})")
    if resolved.index is not None and default.index is not None and resolved.index != default.index:
        raise ValueError(f"device={str(resolved)!r} is not this rank's current device {str(default)!r}; the "
                         "process group communicates on the current device: pass None or "
                         f"{str(default)!r}, or set the current device first")
    return default


def current(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` the current one (CUDA: object collectives on NCCL send from it); CPU: no-op."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def get_rng_state(device: torch.device) -> torch.Tensor:
    """State of the generator that initialises tensors on ``device``."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def is_capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is being captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def host_device() -> torch.device:
    """Host memory: where CPU offload (``fsdp_impl.offload``) keeps what it moves off the device."""
    return torch.device("cpu")


def pinned_memory_available(device: torch.device) -> bool:
    """Whether page-locked host memory can back copies to and from ``device`` (CUDA only; on a
    CPU device the host is the device, so there is nothing to pin)."""
    return device.type == "cuda" and torch.cuda.is_available()


# Below this size ``pinned_zeros`` takes torch's pinned allocator (its power-of-two rounding wastes
# under 1 MiB a buffer); from it up, it page-locks ordinary host memory in place.
PIN_IN_PLACE_MIN_BYTES = 2**20
# ``host_zeros(huge_pages=True)``: the transparent huge page size of x86-64 and most arm64 kernels
HUGE_PAGE_BYTES = 2 * 2**20
_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinning


def pinned_zeros(numel: int, dtype: torch.dtype, huge_pages: bool = False) -> torch.Tensor:
    """Zero-filled page-locked host memory of exactly ``numel`` elements (CUDA only).

    Why not ``torch.zeros(..., pin_memory=True)``: torch's pinned allocator rounds every block up
    to a power of two and caches it, so a 7B unit's 805 MB fp32 buffer takes 1 GiB: about 1.3x
    the host bytes of the offloaded state, which is what bounds the model size offload trains on
    one node. From ``PIN_IN_PLACE_MIN_BYTES`` up, the buffer is ordinary host memory page-locked
    in place (``cudaHostRegister``, as torch's DCP stager does) and unlocked when its storage is
    freed; copies from and to it are asynchronous like those of torch's pinned blocks.
    ``huge_pages``: see ``host_zeros``.
    """
    nbytes = numel * dtype.itemsize
    if nbytes < PIN_IN_PLACE_MIN_BYTES:
        return torch.zeros(numel, dtype=dtype, pin_memory=True)
    tensor = _huge_page_zeros(numel, dtype) if huge_pages else None
    if tensor is None:
        tensor = torch.zeros(numel, dtype=dtype)
    storage = tensor.untyped_storage()
    code = int(_cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), _REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"page-locking {nbytes} bytes of host memory failed (cudaHostRegister error {code}); "
                           "the host may be out of lockable memory (ulimit -l): pass "
                           "OffloadPolicy(pin_memory=False) for pageable, synchronous copies")
    # Not at exit: the CUDA context may be gone by then, and the process's end unlocks the pages.
    weakref.finalize(storage, _host_unregister, storage.data_ptr()).atexit = False
    return tensor


def host_zeros(numel: int, dtype: torch.dtype, pin: bool, huge_pages: bool = False) -> torch.Tensor:
    """A zero-filled host buffer of exactly ``numel`` elements: page-locked (``pinned_zeros``)
    with ``pin``, else pageable. ``huge_pages``: from ``HUGE_PAGE_BYTES`` up, its own mapping,
    aligned to and advised for transparent huge pages (``_huge_page_zeros``; Linux only, and only
    where the kernel's THP mode is ``madvise`` or ``always``; elsewhere the plain buffer). Why
    try it: a host step streams every byte of its params, grads and moments each step, and with
    4 KiB pages each stream needs a new translation every 4 KiB (measured within the noise so
    far: ``OffloadPolicy.huge_pages`` is off by default)."""
    if pin:
        return pinned_zeros(numel, dtype, huge_pages)
    tensor = _huge_page_zeros(numel, dtype) if huge_pages else None
    return tensor if tensor is not None else torch.zeros(numel, dtype=dtype, device=host_device())


def _huge_page_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """``numel`` zeros in an anonymous mapping (zero-filled by the kernel, faulted in on first
    touch) whose first byte is ``HUGE_PAGE_BYTES``-aligned, advised ``MADV_HUGEPAGE`` over the
    whole pages it holds (the tail under a huge page stays in small pages: no byte more is
    resident than the buffer's own). None where that cannot be done (small buffer, no
    ``madvise``, THP off). The tensor keeps the mapping alive; its storage is exactly its bytes."""
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE") or not _thp_available():
        return None
    # private, as malloc's: a shared anonymous mapping is shmem, whose huge pages are a separate switch
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    offset = -base % HUGE_PAGE_BYTES
    _advise(mapping, offset, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return torch.frombuffer(mapping, dtype=dtype, count=numel, offset=offset)


def _advise(mapping: mmap.mmap, offset: int, length: int) -> None:
    """``MADV_HUGEPAGE`` over ``length`` bytes of ``mapping`` from ``offset`` (before any touch, so
    the first faults take huge pages; a function, so tests can see the advice)."""
    mapping.madvise(mmap.MADV_HUGEPAGE, offset, length)


@functools.cache
def _thp_available(path: str = "/sys/kernel/mm/transparent_hugepage/enabled") -> bool:
    """Whether the kernel gives transparent huge pages to a region advised for them (its THP
    mode, the bracketed word of ``path``, is not ``never``; no such file: no THP)."""
    try:
        with open(path) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _cudart() -> Any:
    """torch's CUDA runtime bindings (a function, so CPU-only tests can stand in for them)."""
    return torch.cuda.cudart()


def _host_unregister(ptr: int) -> int:
    """Unlock pages locked by ``pinned_zeros`` (its storage is being freed); returns the CUDA code."""
    return int(_cudart().cudaHostUnregister(ptr))


def free_memory(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can still get (None: unknown): CUDA, what the driver
    has free plus what torch's caching allocator holds unused; CPU, the kernel's estimate of
    available host memory (``MemAvailable``, else the free physical pages)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free) + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, OSError, ValueError):
        return None


def synchronize(device: torch.device) -> None:
    """Wait on the host until every stream of ``device`` is done (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release_cached_memory(device: torch.device) -> None:
    """Hand the caching allocator's unused blocks on ``device`` back to the driver (no-op on CPU).

    Called at the end of a wrap (``fully_shard``: after the optimizer let go of the original
    params too), which has just freed the module's original storage: left cached, those blocks
    (sized for the original params, or for a dtype cast before the wrap) get split by the first
    step's activations, and the holes between them cannot serve the largest later requests.
    Measured on one H200 (2.7B bench GPT, selective recompute, micro-batch 24): out of memory
    with 9.2 GiB reserved but unallocated before; trains with the cache released after the wrap
    (peak 130.04 GiB, as FSDP2's 130.07; ``bench/RESULTS.md``)."""
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.empty_cache()


def current_stream_wait(device: torch.device, event: torch.cuda.Event | None) -> None:
    """Order the current stream of ``device`` after ``event`` (any stream's); no-op on CPU."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)


def wait_on_host(event: torch.cuda.Event | None) -> None:
    """Block the host until ``event`` (from ``CommStream.record``) completed; no-op on CPU."""
    if event is not None:
        event.synchronize()


# Backends of the default process group that take CUDA tensors: NCCL, and torch's ``fake``
# backend (collectives that move nothing, for tracing and for benchmarking one rank's work).
_CUDA_BACKENDS = ("nccl", "fake")


def record_current(device: torch.device) -> torch.cuda.Event | None:
    """An event on the current stream of ``device`` (None on CPU, where work is synchronous):
    what a host thread waits on (``wait_on_host``) before reading what that stream wrote."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def default_device_type() -> str:
    """Device type for a mesh built by us (``device_mesh=None``): CUDA only when the default
    process group can take CUDA tensors (NCCL, fake), so gloo on a GPU node still runs on CPU."""
    backend = str(dist.get_backend()).lower()
    return "cuda" if torch.cuda.is_available() and any(b in backend for b in _CUDA_BACKENDS) else "cpu"


class CommStream:
    """A side stream for collectives (CUDA) or nothing (CPU).

    ``use()`` makes the side stream current after waiting for the compute stream, so the
    collective sees finished inputs; ``record()`` returns an event the consumer waits on.

    ``record_streams=False`` (CUDA-graph mode) turns ``keep_alive``/``used_by_current`` into
    no-ops: cross-stream tensors are then kept safe without ``record_stream``. A tensor made on
    the compute stream and used here is held by its owner until the compute stream waited for
    this stream's event; a tensor made here (inside ``use()``) and consumed on the compute stream
    may be dropped once the consumer is enqueued, because the allocator only hands its block to
    later allocations on this stream, and every one of them happens inside ``use()``, after this
    stream waited for everything the compute stream had enqueued, the consumer included.
    """

    def __init__(self, device: torch.device, side: bool = True, record_streams: bool = True) -> None:
        self.device = device
        self.record_streams = record_streams
        # side=False (fully_shard's overlap_* switches off): collectives run on the compute
        # stream, in order with the compute, exactly as on CPU.
        self._stream: torch.cuda.Stream | None = (
            torch.cuda.Stream(device=device) if device.type == "cuda" and side else None)

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            yield

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Make the side stream current *without* waiting for the compute stream: for work whose
        inputs the caller already ordered (e.g. a host thread that waited for an event)."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> torch.cuda.Event | None:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Make the current (compute) stream wait for ``event``; no-op on CPU."""
        current_stream_wait(self.device, event)

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """``tensor`` (made on the compute stream) was used on the side stream: keep its memory
        from being reused before the side stream is done with it."""
        if self._stream is not None and self.record_streams:
            tensor.record_stream(self._stream)

    def used_by_current(self, tensor: torch.Tensor) -> None:
        """``tensor`` (made on the side stream) is consumed on the current stream."""
        if self._stream is not None and self.record_streams:
            tensor.record_stream(torch.cuda.current_stream(self.device))


class CommStreams:
    """The two side streams of one model: parameter all-gathers and gradient reductions, so a
    reduce-scatter never waits behind the next unit's prefetched all-gather."""

    def __init__(self, device: torch.device, overlap_gather: bool = True, overlap_reduce: bool = True,
                 record_streams: bool = True) -> None:
        self.gather = CommStream(device, overlap_gather, record_streams)
        self.reduce = CommStream(device, overlap_reduce, record_streams)
