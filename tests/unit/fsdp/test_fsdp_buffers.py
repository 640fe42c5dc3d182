"""Single-process checks of the contiguous buffers and the CPU no-op stream abstraction."""
from __future__ import annotations

import torch

from fsdp_impl.buffers import DataParallelBuffer, contiguous_stride
from fsdp_impl.device import CommStream
from fsdp_impl.sharding import FlatLayout


def test_local_views_share_the_buffer_storage() -> None:
    buf = DataParallelBuffer(FlatLayout([(5, 2), (3,)], 2), rank=1, dtype=torch.float32, device=torch.device("cpu"))
    assert buf.data.numel() == 3 * 2 + 2  # padded rows per rank: ceil(5/2)=3, ceil(3/2)=2
    a, b = buf.local_view(0), buf.local_view(1)
    assert a.shape == (2, 2) and b.shape == (1,)  # rank 1 holds rows 3-4 and row 2
    a.fill_(1.0)
    b.fill_(2.0)
    assert buf.data.tolist() == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 2.0, 0.0]


def test_free_and_reallocate_zero_filled() -> None:
    buf = DataParallelBuffer(FlatLayout([(4,)], 2), rank=0, dtype=torch.float32, device=torch.device("cpu"))
    buf.data.fill_(3.0)
    buf.free()
    assert not buf.is_allocated and buf.dtype == torch.float32 and buf.data.shape == (2,)
    buf.ensure_allocated()
    assert buf.is_allocated and buf.data.tolist() == [0.0, 0.0]


def test_contiguous_stride() -> None:
    assert contiguous_stride((4, 3, 2)) == torch.empty(4, 3, 2).stride()
    assert contiguous_stride((0, 3)) == (3, 1)


def test_comm_stream_is_a_no_op_on_cpu() -> None:
    stream = CommStream(torch.device("cpu"))
    with stream.use():
        x = torch.ones(2)
    assert stream.record() is None
    stream.wait(None)
    stream.keep_alive(x)
    stream.used_by_current(x)


def test_take_zeroed_only_after_an_untouched_zero_of_the_same_capture() -> None:
    """The overwrite licence: granted once per zero(), lost by any in-place write (also through
    a view) and never granted across capture tokens (an eager zero does not count in a capture)."""
    buf = DataParallelBuffer(FlatLayout([(4,)], 1), rank=0, dtype=torch.float32, device=torch.device("cpu"))
    assert not buf.take_zeroed(None), "never zeroed"
    buf.zero(None)
    assert buf.take_zeroed(None)
    assert not buf.take_zeroed(None), "the licence is used up"
    buf.zero(None)
    buf.local_view(0).add_(1.0)  # a user writes into .grad after zero_grad
    assert not buf.take_zeroed(None)
    graph = object()
    buf.zero(None)
    assert not buf.take_zeroed(graph), "an eager zero must not let a captured backward overwrite"
    buf.zero(graph)
    assert not buf.take_zeroed(object())
    buf.zero(graph)
    assert buf.take_zeroed(graph)
