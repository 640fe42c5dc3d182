"""``device.pinned_zeros`` without a GPU: CUDA's runtime is stood in for by a recorder, so the
bytes locked, the unlock when the storage dies and the error path are checked on every CI run.
``tests/functional/test_offload_gpu.py`` checks the same on a real device (pinned, exact bytes,
outside torch's caching host allocator, asynchronous round trip)."""
from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from fsdp_impl import device


class FakeCudart:
    """Records cudaHostRegister / cudaHostUnregister calls; returns ``code`` from register."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size, flags))
        return self.code

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(device, "_cudart", lambda: fake)
    return fake


@pytest.mark.parametrize("numel,dtype", [(201_326_592 // 64 + 3, torch.float32), (2**19 + 1, torch.bfloat16),
                                         (device.PIN_IN_PLACE_MIN_BYTES // 4, torch.float32)])
def test_locks_exactly_the_buffer_bytes_and_unlocks_when_freed(numel: int, dtype: torch.dtype,
                                                               cudart: FakeCudart) -> None:
    tensor = device.pinned_zeros(numel, dtype)
    assert tensor.shape == (numel,) and tensor.dtype == dtype and tensor.device.type == "cpu"
    assert int(tensor.count_nonzero()) == 0
    ptr = tensor.untyped_storage().data_ptr()
    # exactly the buffer's bytes: no power-of-two rounding (numel * itemsize is not a power of two)
    assert cudart.registered == [(ptr, numel * dtype.itemsize, 1)]
    view = tensor[1:]  # a view keeps the storage (and its lock) alive
    del tensor
    gc.collect()
    assert cudart.unregistered == []
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_small_buffers_take_torchs_pinned_allocator(cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real_zeros = torch.zeros

    def zeros(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(dict(kwargs))
        kwargs.pop("pin_memory", None)  # no CUDA here: record the request, hand back host memory
        return real_zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", zeros)
    numel = device.PIN_IN_PLACE_MIN_BYTES // 4 - 1
    tensor = device.pinned_zeros(numel, torch.float32)
    assert tensor.numel() == numel
    assert calls == [{"dtype": torch.float32, "pin_memory": True}]
    assert cudart.registered == []


def test_a_failed_lock_is_an_error_naming_the_way_out(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart(code=2)  # cudaErrorMemoryAllocation
    monkeypatch.setattr(device, "_cudart", lambda: fake)
    with pytest.raises(RuntimeError, match=r"cudaHostRegister error 2.*OffloadPolicy\(pin_memory=False\)"):
        device.pinned_zeros(2**20, torch.float32)


HUGE = device.HUGE_PAGE_BYTES
needs_madvise = pytest.mark.skipif(not hasattr(__import__("mmap"), "MADV_HUGEPAGE"),
                                   reason="huge pages need mmap.MADV_HUGEPAGE (Linux)")


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """THP said to be available, and the advice recorded instead of given (the kernel may lack THP)."""
    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(device, "_thp_available", lambda: True)
    monkeypatch.setattr(device, "_advise", lambda mapping, offset, length: seen.append((offset, length)))
    return seen


@needs_madvise
@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_huge_pages_give_an_aligned_buffer_of_exactly_its_bytes(pin: bool, cudart: FakeCudart,
                                                                 advised: list[tuple[int, int]]) -> None:
    """Three huge pages and 20 bytes: the buffer starts on a huge-page boundary, holds exactly its
    bytes, reads as zeros, is advised over its three whole pages only (the 20-byte tail stays in
    small pages: nothing more is resident), and (pinned) is locked exactly; its values survive."""
    numel = 3 * HUGE // 4 + 5
    tensor = device.host_zeros(numel, torch.float32, pin=pin, huge_pages=True)
    ptr = tensor.untyped_storage().data_ptr()
    assert tensor.shape == (numel,) and ptr % HUGE == 0 and tensor.untyped_storage().nbytes() == numel * 4
    assert int(tensor.count_nonzero()) == 0
    assert len(advised) == 1 and advised[0][1] == 3 * HUGE, advised
    assert cudart.registered == ([(ptr, numel * 4, 1)] if pin else [])
    values = torch.arange(numel, dtype=torch.float32)
    tensor.copy_(values)
    assert torch.equal(tensor, values)
    del tensor
    gc.collect()
    assert cudart.unregistered == ([ptr] if pin else [])


@needs_madvise
def test_huge_pages_leave_small_buffers_and_thp_off_alone(cudart: FakeCudart, advised: list[tuple[int, int]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Under one huge page, or with the kernel's THP mode ``never``, the buffer is the ordinary
    one (no mapping of its own, no advice); ``huge_pages=False`` never advises."""
    small = device.host_zeros(HUGE // 4 - 1, torch.float32, pin=True, huge_pages=True)
    assert small.untyped_storage().nbytes() == HUGE - 4 and advised == []
    device.host_zeros(HUGE, torch.float32, pin=False, huge_pages=False)
    assert advised == []
    monkeypatch.setattr(device, "_thp_available", lambda: False)
    device.host_zeros(HUGE, torch.float32, pin=False, huge_pages=True)
    assert advised == []


@needs_madvise
def test_thp_mode_is_read_from_the_kernel(tmp_path: Any) -> None:
    """``never`` selected: unavailable; ``madvise`` or ``always``: available; no file: unavailable."""
    for name, text, expect in (("never", "always madvise [never]\n", False),
                               ("madvise", "always [madvise] never\n", True),
                               ("always", "[always] madvise never\n", True), ("missing", None, False)):
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        assert device._thp_available(str(path)) is expect, text


@needs_madvise
@pytest.mark.parametrize("huge_pages", [True, False])
def test_offload_host_buffers_follow_the_policys_huge_pages(huge_pages: bool, advised: list[tuple[int, int]]) -> None:
    """``OffloadPolicy.huge_pages`` reaches the unit's host buffers (``host_buffer``): a 4 MiB +
    12-byte weight buffer is advised over its two whole huge pages and starts on one, or (False)
    is the ordinary buffer, never advised; either way its values and layout are the same."""
    from fsdp_impl.buffers import DataParallelBuffer
    from fsdp_impl.offload.host import OffloadPolicy, host_buffer
    from fsdp_impl.sharding import FlatLayout

    like = DataParallelBuffer(FlatLayout([(HUGE // 4, 2), (3,)], 1), rank=0, dtype=torch.float32,
                              device=torch.device("cpu"))
    buf = host_buffer(like, OffloadPolicy(step="cpu", pin_memory=False, huge_pages=huge_pages))
    assert buf.data.numel() == like.data.numel() and int(buf.data.count_nonzero()) == 0
    if huge_pages:
        assert buf.data.data_ptr() % HUGE == 0 and advised == [(advised[0][0], 2 * HUGE)], advised
    else:
        assert advised == []


@needs_madvise
@pytest.mark.parametrize("huge_pages", [True, False])
def test_host_moments_follow_the_units_huge_pages(huge_pages: bool, advised: list[tuple[int, int]]) -> None:
    """``offload.optim.host_zeros_like`` (the overlapped host step's Adam moments, the device
    step's pinned ones) reads the unit's policy: a 2 MiB + 12-byte moment starts on a huge page
    and is advised over its one whole page, or (False) is an ordinary buffer, never advised;
    either way zeros of ``like``'s shape and dtype, ``like`` itself untouched."""
    from types import SimpleNamespace

    from fsdp_impl.offload.host import OffloadPolicy
    from fsdp_impl.offload.optim import host_zeros_like

    unit = SimpleNamespace(offload=SimpleNamespace(policy=OffloadPolicy(step="cpu", pin_memory=False,
                                                                        huge_pages=huge_pages)))
    like = torch.ones(HUGE // 4 + 3)
    moment = host_zeros_like(like, unit, None, pin=False)  # type: ignore[arg-type]
    assert moment.shape == like.shape and moment.dtype == like.dtype and int(moment.count_nonzero()) == 0
    assert int(like.count_nonzero()) == like.numel()
    if huge_pages:
        assert moment.data_ptr() % HUGE == 0 and advised == [(advised[0][0], HUGE)], advised
    else:
        assert advised == []
