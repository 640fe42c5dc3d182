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
