"""The overlap worker (``OffloadPolicy.overlap_step``): one thread per cycle running the units'
tasks (steps or norms), in submission order or, once a step runs on into the next forward, in
forward order; each task's event is set when it ran, so a gather can wait for its unit."""
from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable

import torch

_WORKER_NAME = "fsdp-offload-step"
# GIL switch interval while a worker whose step runs on into the forward lives (seconds). The worker
# takes the GIL back after each tensor op; beside a thread running Python (a forward launching
# kernels) each take waits up to the interval, 5 ms by default. On CPU (two threads, 25 unit-like
# steps of small ops and one fused Adam each): 18 ms alone, 2,123 ms beside a Python-busy thread
# at 5 ms, 98 ms at 0.1 ms.
FORWARD_SWITCH_INTERVAL_S = 2e-4


class _Tasks:
    """The worker's queue: submission order, or (``by_unit_order``, from the end of a backward
    whose step runs on into the next forward) lowest unit order first, so the next forward's
    first units are the first done. Order does not change the numbers: the units' steps are
    independent. Each task comes with the event set once it ran or was skipped, and the
    intra-op width asked for from then on (``widen``; None: unchanged)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: list[tuple[int, Callable[[], None], threading.Event]] = []
        self._closed = False
        self._by_order = False
        self._width: int | None = None

    def put(self, task: Callable[[], None], order: int, done: threading.Event) -> None:
        with self._cond:
            self._items.append((order, task, done))
            self._cond.notify()

    def by_unit_order(self) -> None:
        with self._cond:
            self._by_order = True

    def widen(self, width: int) -> None:
        with self._cond:
            self._width = width

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def get(self) -> tuple[Callable[[], None], threading.Event, int | None] | None:
        """The next task (blocking) and the width asked for, or None once closed and empty."""
        with self._cond:
            while not self._items and not self._closed:
                self._cond.wait()
            if not self._items:
                return None
            pick = min(range(len(self._items)), key=lambda i: self._items[i][0]) if self._by_order else 0
            _, task, done = self._items.pop(pick)
            return task, done, self._width


def spare_threads(width: int) -> int:
    """Intra-op threads for host steps that run beside the training thread: one fewer than the
    caller's ``width`` (at least one). While the worker steps, the thread driving the device (the
    forward, the autograd engine's) is busy too; with every core in the kernel's parallel region,
    the region waits for whichever of its threads shares a core with it. For elementwise kernels
    only (Adam): their bits do not depend on how the elements are split between threads."""
    return max(1, width - 1)


def _work(tasks: _Tasks, errors: list[BaseException], threads: int) -> None:
    """The worker thread's loop: run tasks until the queue closes; after a failure the remaining
    tasks are skipped (the cycle is lost), the error is kept for ``join``. Every task's event is
    set, run or skipped, so nothing waiting on a unit hangs."""
    # the intra-op width its tasks run with: the caller's (reductions split the same way, same
    # bits) or, for elementwise steps, ``spare_threads`` of it. Set on this thread only (OpenMP
    # keeps the width per thread); torch also stores it for threads started later, so the
    # caller's width is put back before the loop ends.
    restore = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _run(tasks, errors)
    finally:
        torch.set_num_threads(restore)


def _run(tasks: _Tasks, errors: list[BaseException]) -> None:
    width = torch.get_num_threads()
    while True:
        item = tasks.get()
        if item is None:
            return
        task, done, wanted = item
        if wanted is not None and wanted != width:  # between tasks: a unit's step runs at one width
            torch.set_num_threads(wanted)
            width = wanted
        try:
            if not errors:
                task()
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()


def _stop(tasks: _Tasks, thread: threading.Thread, interval: tuple[float, float] | None) -> None:
    """Finalizer: end a worker whose controller went away (never from the worker itself), and
    give back the GIL switch interval it lowered (``interval``: (before, set); left alone if
    someone changed it since)."""
    tasks.close()
    if thread is not threading.current_thread():
        thread.join()
    if interval is not None and sys.getswitchinterval() == interval[1]:
        sys.setswitchinterval(interval[0])


class StepWorker:
    """One thread running the tasks of one cycle (submission order, or unit order once asked);
    ``join`` ends it and re-raises the first error of a task in the calling thread.
    ``quick_gil=True`` (a step running on into the forward): the GIL switch interval is lowered
    to ``FORWARD_SWITCH_INTERVAL_S`` while the thread lives, and restored at ``join``.
    ``threads``: the tasks' intra-op width (default: the caller's, ``torch.get_num_threads()``)."""

    def __init__(self, quick_gil: bool = False, threads: int | None = None) -> None:
        self._tasks = _Tasks()
        self._errors: list[BaseException] = []
        interval = None
        if quick_gil and sys.getswitchinterval() > FORWARD_SWITCH_INTERVAL_S:
            interval = (sys.getswitchinterval(), FORWARD_SWITCH_INTERVAL_S)
            sys.setswitchinterval(FORWARD_SWITCH_INTERVAL_S)
            interval = (interval[0], sys.getswitchinterval())  # as Python stores it
        width = torch.get_num_threads() if threads is None else threads
        self._thread = threading.Thread(target=_work, args=(self._tasks, self._errors, width),
                                        name=_WORKER_NAME, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._tasks, self._thread, interval)
        self.failure: BaseException | None = None  # a task error seen by join_after_failure

    def submit(self, task: Callable[[], None], order: int = 0) -> threading.Event:
        """Queue ``task``; the returned event is set once it ran (or was skipped after a failure)."""
        done = threading.Event()
        self._tasks.put(task, order, done)
        return done

    def by_unit_order(self) -> None:
        """From now on run the queued tasks lowest ``order`` first."""
        self._tasks.by_unit_order()

    def widen(self, width: int) -> None:
        """Run the tasks not yet started at intra-op width ``width`` (the caller is about to wait
        for them and leaves its core free; elementwise steps only: the bits do not change)."""
        self._tasks.widen(width)

    def raise_failure(self) -> None:
        """Re-raise the first task error, if any, without ending the thread."""
        if self._errors:
            raise self._errors[0]

    def join(self) -> None:
        """Wait for every submitted task; raise the first task error (its own exception). May be
        called again: the thread is ended once, the error raised each time."""
        self._finalizer()  # closes the queue and joins, the first time only
        self.raise_failure()

    def join_after_failure(self) -> None:
        """Join when another error is being raised (the task error, if any, is its cause)."""
        try:
            self.join()
        except BaseException as error:
            self.failure = error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def failed(self) -> bool:
        return bool(self._errors)


__all__ = ["StepWorker", "spare_threads"]
