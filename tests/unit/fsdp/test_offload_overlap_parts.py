"""``OffloadPolicy(overlap_step=...)`` pieces without a process group: the field's validation, the
optimizer check, the worker thread (order, error re-raise, no thread left) and the overlap share.
The overlapped training itself is checked on gloo in ``tests/functional/test_offload_overlap.py``."""
from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch
import torch.nn as nn

from fsdp_impl.offload.host import OffloadPolicy
from fsdp_impl.offload.optim import check_offload_optimizer
from fsdp_impl.offload.overlap import OverlappedStep, OverlapTimes
from fsdp_impl.offload.worker import FORWARD_SWITCH_INTERVAL_S, StepWorker, spare_threads


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "fsdp-offload-step"]


@pytest.mark.parametrize("value", [False, True, "clip"])
def test_overlap_step_accepts_its_values(value: object) -> None:
    assert OffloadPolicy(step="cpu", pin_memory=False, overlap_step=value).overlap_step == value  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["yes", "Clip", 1, 0, None, 1.0])
def test_overlap_step_names_its_allowed_values(value: object) -> None:
    allowed = r"\(False, True, 'clip', 'forward'\)"
    with pytest.raises(ValueError, match=r"^OffloadPolicy\.overlap_step must be one of " + allowed + ", got "):
        OffloadPolicy(overlap_step=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_upload_ahead_is_a_bool(value: object) -> None:
    with pytest.raises(TypeError, match=r"^OffloadPolicy\.upload_ahead must be True or False, got "):
        OffloadPolicy(upload_ahead=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_huge_pages_is_a_bool(value: object) -> None:
    with pytest.raises(TypeError, match=r"^OffloadPolicy\.huge_pages must be True or False, got "):
        OffloadPolicy(huge_pages=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, "clip"])
def test_overlap_needs_host_grads(value: object) -> None:
    with pytest.raises(ValueError, match=r"overlap_step=.*grads must be on the host"):
        OffloadPolicy(main_params=False, overlap_step=value)  # type: ignore[arg-type]
    assert OffloadPolicy(main_params=False, grads=True, overlap_step=value).grads_on_host  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [dict(step="gpu", overlap_step=True), dict(step="cpu", overlap_step=False),
                                    dict(step="cpu", overlap_step="clip")])
def test_compute_copy_on_host_needs_the_overlapped_host_step(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"compute_copy_on_host=True\).* needs step='cpu' and overlap_step True"):
        OffloadPolicy(pin_memory=False, compute_copy_on_host=True, **kwargs)
    with pytest.raises(ValueError, match=r"compute_copy_on_host='device'\).* needs step='cpu' and overlap_step True"):
        OffloadPolicy(pin_memory=False, params=True, compute_copy_on_host="device", **kwargs)  # type: ignore[arg-type]
    OffloadPolicy(pin_memory=False, step="cpu", overlap_step="forward", compute_copy_on_host=True)


@pytest.mark.parametrize("value", [1, 0, "host", None])
def test_compute_copy_on_host_names_its_allowed_values(value: object) -> None:
    allowed = r"\(False, True, 'device'\)"
    with pytest.raises(ValueError, match=r"^OffloadPolicy\.compute_copy_on_host must be one of " + allowed):
        OffloadPolicy(pin_memory=False, step="cpu", overlap_step=True, compute_copy_on_host=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [dict(params=False), dict(params=True, upload_ahead=False)])
def test_a_device_cast_host_copy_needs_host_params_uploaded_ahead(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"compute_copy_on_host='device'\).*needs params=True and upload_ahead=True"):
        OffloadPolicy(pin_memory=False, step="cpu", overlap_step=True, compute_copy_on_host="device", **kwargs)
    OffloadPolicy(pin_memory=False, step="cpu", overlap_step=True, params=True, compute_copy_on_host="device")


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_step_threads_takes_a_positive_int(value: object) -> None:
    with pytest.raises(ValueError, match=r"^OffloadPolicy\.step_threads must be None or an int >= 1, got "):
        OffloadPolicy(pin_memory=False, step="cpu", overlap_step=True, step_threads=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [dict(step="gpu", overlap_step=True), dict(step="cpu", overlap_step="clip")])
def test_step_threads_needs_the_overlapped_host_step(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"step_threads=3\) sets the width of the overlapped host step"):
        OffloadPolicy(pin_memory=False, step_threads=3, **kwargs)


@pytest.mark.parametrize("value", [-1, 1.5, True, "4", None])
def test_device_step_units_takes_a_non_negative_int(value: object) -> None:
    with pytest.raises(ValueError, match=r"^OffloadPolicy\.device_step_units must be an int >= 0, got "):
        OffloadPolicy(pin_memory=False, step="cpu", overlap_step=True, params=True,
                      device_step_units=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [dict(step="gpu", overlap_step=True, params=True),
                                    dict(step="cpu", overlap_step="forward", params=True),
                                    dict(step="cpu", overlap_step=True, params=False),
                                    dict(step="cpu", overlap_step=True, params=True, upload_ahead=False),
                                    dict(step="cpu", overlap_step=True, params=True, compute_copy_on_host=True)])
def test_device_step_units_needs_the_overlapped_host_step_on_host_params(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"device_step_units=2\) steps units on the device inside the overlapped "
                                         r"host step, so it needs step='cpu', overlap_step=True, params=True"):
        OffloadPolicy(pin_memory=False, device_step_units=2, **kwargs)
    OffloadPolicy(pin_memory=False, step="cpu", overlap_step=True, params=True, device_step_units=2)
    OffloadPolicy(pin_memory=False, device_step_units=0, **kwargs)  # 0: off, anywhere


def test_overlapped_steps_need_adam_but_clip_mode_takes_any_optimizer() -> None:
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match=r"OffloadPolicy\(overlap_step=True\) steps Adam/AdamW unit by unit.*SGD"):
        check_offload_optimizer(OffloadPolicy(step="cpu", pin_memory=False, overlap_step=True),
                                torch.optim.SGD(params, lr=0.1))
    check_offload_optimizer(OffloadPolicy(step="cpu", pin_memory=False, overlap_step="clip"),
                            torch.optim.SGD(params, lr=0.1))
    check_offload_optimizer(OffloadPolicy(step="cpu", pin_memory=False, overlap_step=True),
                            torch.optim.AdamW(params, lr=0.1))


def test_worker_runs_tasks_in_order_and_leaves_no_thread() -> None:
    seen: list[int] = []
    worker = StepWorker()
    for i in range(20):
        worker.submit(lambda i=i: seen.append(i))
    worker.join()
    worker.join()  # again: nothing more to wait for
    assert seen == list(range(20))
    assert not worker.alive and not _workers()


def test_worker_error_is_reraised_and_later_tasks_are_skipped() -> None:
    seen: list[str] = []
    worker = StepWorker()
    worker.submit(lambda: seen.append("a"))
    worker.submit(lambda: (_ for _ in ()).throw(ZeroDivisionError("task two")))
    worker.submit(lambda: seen.append("c"))
    with pytest.raises(ZeroDivisionError, match="task two"):
        worker.join()
    assert seen == ["a"] and not worker.alive


def test_worker_picks_forward_order_once_asked_and_sets_each_tasks_event() -> None:
    """Landing order until ``by_unit_order``, then lowest order first; every task's event is set,
    also for a task skipped after a failure (a gather waiting on it must not hang)."""
    seen: list[int] = []
    gate = threading.Event()
    worker = StepWorker()
    worker.submit(gate.wait, order=99)  # holds the worker until the rest is queued
    events = [worker.submit(lambda i=i: seen.append(i), order=i) for i in (5, 3, 4)]
    failing = worker.submit(lambda: (_ for _ in ()).throw(KeyError("x")), order=6)
    skipped = worker.submit(lambda: seen.append(-1), order=7)
    worker.by_unit_order()
    gate.set()
    with pytest.raises(KeyError):
        worker.join()
    assert seen == [3, 4, 5] and all(e.is_set() for e in events) and failing.is_set() and skipped.is_set()
    assert worker.failed


def test_a_running_on_worker_lowers_the_gil_switch_interval_until_joined() -> None:
    before = sys.getswitchinterval()
    worker = StepWorker(quick_gil=True)
    assert sys.getswitchinterval() == pytest.approx(FORWARD_SWITCH_INTERVAL_S)
    worker.join()
    assert sys.getswitchinterval() == before
    plain = StepWorker()
    assert sys.getswitchinterval() == before
    plain.join()


def test_worker_tasks_run_at_the_width_asked_and_the_callers_stays() -> None:
    """``threads``: the tasks' intra-op width, set on the worker thread only; a thread started
    after the worker ended gets the caller's width again (torch stores the last width set)."""
    caller = torch.get_num_threads()
    seen: list[int] = []
    worker = StepWorker(threads=1)
    worker.submit(lambda: seen.append(torch.get_num_threads()))
    worker.join()
    assert seen == [1] and torch.get_num_threads() == caller
    later: list[int] = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert later == [caller]
    assert [spare_threads(w) for w in (1, 2, 16)] == [1, 1, 15]


def test_widen_applies_to_the_tasks_not_yet_started() -> None:
    """``StepWorker.widen``: tasks taken after it run at the new width (set between tasks), the
    task already running keeps its own; the caller's width is untouched."""
    caller = torch.get_num_threads()
    seen: list[int] = []
    started, release = threading.Event(), threading.Event()

    def first() -> None:
        seen.append(torch.get_num_threads())
        started.set()
        assert release.wait(10)
        seen.append(torch.get_num_threads())
    worker = StepWorker(threads=1)
    running = worker.submit(first)
    assert started.wait(10)
    worker.widen(3)
    release.set()
    assert running.wait(10)
    worker.submit(lambda: seen.append(torch.get_num_threads()))
    worker.join()
    assert seen == [1, 1, 3] and torch.get_num_threads() == caller


def test_the_host_step_runs_at_step_threads_else_one_core_fewer() -> None:
    """``OffloadPolicy.step_threads`` sets the overlapped host step's width; None spares a core;
    the norms of ``"clip"`` (a reduction) keep the caller's width."""
    opt = torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=0.1)
    width = torch.get_num_threads()

    def threads(**kwargs: object) -> int:
        policy = OffloadPolicy(pin_memory=False, step="cpu", **kwargs)  # type: ignore[arg-type]
        return OverlappedStep(opt, policy, torch.device("cpu"))._worker_threads()
    assert threads(overlap_step=True) == threads(overlap_step="forward") == spare_threads(width)
    assert threads(overlap_step=True, step_threads=7) == threads(overlap_step="forward", step_threads=7) == 7
    assert threads(overlap_step="clip") == width


def test_fused_host_adam_gives_the_same_bits_at_any_width() -> None:
    """Why the overlapped host step may run one core narrower (``spare_threads``): torch's fused
    CPU AdamW is elementwise, so how the elements are split between threads changes no bit."""
    def step(width: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(0)
        p, g = torch.randn(300_001, generator=gen), torch.randn(300_001, generator=gen)
        m, v = torch.randn(300_001, generator=gen), torch.rand(300_001, generator=gen)
        out: list[list[torch.Tensor]] = []

        def run() -> None:
            torch.set_num_threads(width)
            torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(3.0)], lr=1e-2, beta1=0.9, beta2=0.99,
                                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False)
            out.append([p, m, v])
        thread = threading.Thread(target=run)  # its own width, as the worker's
        thread.start()
        thread.join()
        return out[0]
    narrow, wide = step(1), step(max(2, torch.get_num_threads()))
    assert all(torch.equal(a, b) for a, b in zip(narrow, wide, strict=True))


def test_a_dropped_worker_ends_its_thread() -> None:
    started = threading.Event()
    worker = StepWorker()
    worker.submit(started.set)
    assert started.wait(10)
    thread = worker._thread
    del worker
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_hidden_share_is_the_busy_time_before_the_end_of_the_backward() -> None:
    times = OverlapTimes(busy=[(0.0, 1.0), (1.0, 3.0), (4.0, 5.0)], backward_end=2.0)
    assert times.hidden_share() == pytest.approx(2.0 / 4.0)
    assert OverlapTimes(busy=[(0.0, 1.0)]).hidden_share() is None  # the backward never ended
    assert OverlapTimes(backward_end=1.0).hidden_share() is None  # nothing ran
