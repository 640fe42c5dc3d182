"""Overlap of the offloaded optimizer step with the backward (``OffloadPolicy.overlap_step``).

Without overlap the sync backward ends, every unit's reduced grads move to host memory, the host
waits, and ``optimizer.step()`` updates everything. With ``overlap_step`` the work starts per unit
as soon as that unit's reduced grads *land* (its post-backward reduction, reverse forward order):

* **landing** (the autograd thread, ``OverlappedStep.unit_landed``): the unit's grads are copied
  into its host buffer on the reduce stream, after its reduction, and an event marks the copy;
  one task per unit goes to a worker thread.
* **the worker** (``StepWorker``, one thread per sync backward, tasks in landing order): waits for
  the unit's copy on the host, then
  - ``overlap_step=True``: steps that unit's params (``step="cpu"``: the host kernel,
    ``optim.host_step_units``, then the upload of the unit's new weights into its device compute
    shard on a side stream, which the next forward's gather would otherwise make, exposed;
    ``step="gpu"``: the unit's chunks through the device window on a side stream, which also
    writes the compute shard, ``OffloadedAdamStep.step(only=...)``);
  - ``overlap_step="clip"``: computes the per-param norms ``clip_grad_norm`` needs (the same
    ``torch._foreach_norm`` over the same host grads), and steps nothing.
* **end of the backward** (``backward_done``): units whose grads landed only there (an unused
  param, HSDP's outer all-reduce, ``report_nan_in_param_grad``) get their task now.
* **``optimizer.step()``** (``finish``): joins the worker, re-raises its first error, checks that
  nothing the step read changed since (hyper-parameters, grads), and marks the cycle consumed.
  With ``"clip"`` it runs the usual step after the worker is joined (``close``). With
  ``"forward"`` it checks and returns: the worker runs on, lowest forward position first
  (``stepping``), each unit's gather in the next forward waits for its task
  (``UnitOffload.await_step``), and ``join_stepping`` (a new backward, ``state_dict``,
  ``wait_for_step``...) waits for the rest. Units step with the hyper-parameters of the cycle's
  start (``_Cycle.snapshot``), so a scheduler may move ``lr`` right after ``step()``.

Why the numbers do not change: Adam is elementwise with a step counter per param, so stepping
the params unit by unit with the group's own flags and kernel gives the values of one step over
all of them; the norms are the same per-tensor norms, stacked in the same order. Grad
accumulation lands only on the sync backward (``engine.sync``), after the last microbatch.

Guards (each raises naming ``overlap_step`` rather than training on silently wrong numbers):
``clip_grad_norm`` after an ``overlap_step=True`` backward (the update is done: clipping now
would scale grads already applied); a forward, ``zero_grad`` or another sync backward before
``optimizer.step()`` consumed the cycle; hyper-parameters (``lr``...) or grads changed between
the backward and ``step()``; ``grad_scale``/``found_inf`` (GradScaler) set at ``step()``.

No collective runs in the worker: it does only local math and copies, so the collective order of
every rank is the one without overlap. The worker thread lives for one cycle: ``finish``/``close``
join it, and a finalizer stops it if the optimizer goes away with a cycle open.
"""
from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import torch
from torch.profiler import record_function

from ..device import CommStream, current, record_current, wait_on_host
from ..placement import local_tensor
from .worker import StepWorker, spare_threads

if TYPE_CHECKING:
    from ..engine import FSDPEngine
    from ..param import ManagedParam
    from ..unit import FSDPUnit
    from .host import OffloadPolicy

_MODEL_STRIDE = 1 << 32  # forward-order keys: models of a cycle apart by more units than any model has


@dataclass
class OverlapTimes:
    """Host timestamps (``time.perf_counter``) of one cycle, for the bench's overlap share: the
    worker's busy intervals and when the backward ended."""

    busy: list[tuple[float, float]] = field(default_factory=list)
    backward_end: float | None = None
    step_end: float | None = None
    landed: int = 0  # units queued as their grads landed, during the backward
    at_end: int = 0  # units queued at the end of the backward
    norm_hits: int = 0  # "clip": grads whose norm clip_grad_norm took from the backward's
    # seconds the worker spent per phase ("grads": waiting for a unit's grads to land on the host;
    # "step", "host_copy", "upload": ``_step_unit``'s parts): tells a link-bound cycle from a host-bound one
    phases: dict[str, float] = field(default_factory=dict)
    # each unit's host Adam: (start, end, elements stepped); the bench's rate during the backward
    # and after it tells contention with the backward (DMA, the driving thread) from the kernel's own rate
    stepped: list[tuple[float, float, int]] = field(default_factory=list)

    def add(self, phase: str, since: float) -> float:
        """Count the time from ``since`` to now against ``phase``; return now."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now

    def hidden_share(self) -> float | None:
        """The share of the worker's busy time that lay before the end of the backward."""
        if self.backward_end is None or not self.busy:
            return None
        total = sum(b - a for a, b in self.busy)
        hidden = sum(max(0.0, min(b, self.backward_end) - a) for a, b in self.busy)
        return hidden / total if total > 0 else None


@dataclass
class _Cycle:
    """What one sync backward started (until ``optimizer.step()`` consumes it)."""

    worker: StepWorker
    snapshot: list[dict[str, Any]]  # the param groups' hyper-parameters when it started
    units: list[FSDPUnit] = field(default_factory=list)  # in landing order
    grad_marks: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # host grads, version at the end
    norms: dict[int, torch.Tensor] = field(default_factory=dict)  # "clip": id(param) -> its grad's norm
    # "clip": id(local grad) -> (that grad, its version at the end of the backward, id(param))
    norm_marks: dict[int, tuple[torch.Tensor, int, int]] = field(default_factory=dict)
    engines: list[FSDPEngine] = field(default_factory=list)  # the models whose sync backward it belongs to
    done: list[FSDPEngine] = field(default_factory=list)  # those whose end-of-backward ran
    times: OverlapTimes = field(default_factory=OverlapTimes)
    downloads: list[Any] = field(default_factory=list)  # device_step_units: events step() waits for

    @property
    def finished(self) -> bool:
        """Every model of the cycle ended its backward."""
        return bool(self.done) and all(any(e is d for d in self.done) for e in self.engines)

    def has(self, engine: FSDPEngine) -> bool:
        return any(engine is e for e in self.engines)


def _hyper(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups without their params (tensor values cloned: an in-place lr change shows)."""
    return [{k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in g.items() if k != "params"}
            for g in groups]


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return bool(a == b)


class OverlappedStep:
    """The overlap of one optimizer bound to offloaded models (``OffloadPolicy.overlap_step``).
    The optimizer is held weakly: the models keep this object, and must not keep the optimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, policy: OffloadPolicy, device: torch.device) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.policy = policy
        self.mode = policy.overlap_step
        self.device = device
        # off the compute stream: step="gpu": the overlapped step's math; "cpu": the uploads made ahead
        self.stream = CommStream(device)
        self.device_stream = CommStream(device)  # device_step_units: not behind the uploads made ahead
        self.steps = policy.steps_in_backward  # True or "forward": units step as their grads land
        self.runs_on = policy.overlap_step == "forward"  # and the step runs on into the next forward
        self.cycle: _Cycle | None = None
        self.stepping: _Cycle | None = None  # "forward": a consumed cycle whose worker may still run
        self.last_times: OverlapTimes | None = None  # the last consumed cycle's timestamps (bench)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._optimizer()

    # ------------------------------------------------------------------ landing
    def defers(self, engine: FSDPEngine) -> bool:
        """Whether a unit's grads are final only at the end of the backward (HSDP's outer
        all-reduce comes after every unit; ``report_nan_in_param_grad`` checks every grad first)."""
        return engine.outer_reducer is not None or engine.config.report_nan_in_param_grad

    def unit_landed(self, engine: FSDPEngine, unit: FSDPUnit) -> None:
        """The sync backward reduced ``unit``'s grads: copy them to the host after the
        reduction and queue the unit's task."""
        if (self.optimizer is None or unit.grad is None or unit.offload is None or unit.offload.landed
                or self.defers(engine)):
            return
        cycle = self._cycle(engine)
        streams = unit.ctx.streams
        with streams.reduce.use():  # after the unit's reduction, off the compute stream
            streams.reduce.keep_alive(unit.grad.data)  # the copy reads it here; it is freed below
            unit.offload.grads_to_host(unit.grad)
            event = record_current(self.device)
        unit.offload.landed = True
        cycle.times.landed += 1
        self._submit(cycle, engine, unit, event)

    def backward_done(self, engine: FSDPEngine) -> None:
        """End of a sync backward (grads installed and on the host): queue the units that did not
        land during it, then remember the grads' versions (a later in-place change shows)."""
        if self.optimizer is None:
            return
        cycle = self._cycle(engine)
        for unit in reversed(engine.units):
            if unit.grad is not None and unit.offload is not None and not unit.offload.landed:
                cycle.times.at_end += 1
                self._submit(cycle, engine, unit, None)
            if unit.offload is not None:
                unit.offload.landed = False
        for unit in engine.units:
            if unit.offload is not None and unit.offload.host_grad is not None:
                cycle.grad_marks.append((unit.offload.host_grad.data, unit.offload.host_grad.data._version))
        if self.mode == "clip":
            decoupled = engine.config.use_decoupled_grad
            from ..decoupled import read_grad
            for unit in engine.units:
                for mp in unit.trainable:
                    grad = read_grad(mp.sharded, decoupled)
                    if grad is not None:
                        local = local_tensor(grad)
                        cycle.norm_marks[id(local)] = (local, local._version, id(mp.sharded))
        cycle.done.append(engine)
        cycle.times.backward_end = time.perf_counter()

    def _cycle(self, engine: FSDPEngine) -> _Cycle:
        """The open cycle, or a new one (after consuming or refusing the previous one: ``engine``
        ends its backward twice in one cycle). Several models may share the optimizer: each
        joins the cycle with its own backward."""
        self.join_stepping()  # the last step's units are done before new grads land
        if self.cycle is not None and any(engine is d for d in self.cycle.done):
            if self.steps:
                self._refuse("a sync backward ran again before optimizer.step() followed the previous one: with "
                             "OffloadPolicy(overlap_step=True) every sync backward steps the params as its grads "
                             "land, so call optimizer.step() after each (or use overlap_step=False)")
            self.close()  # "clip": nothing stepped; the grads accumulate as without overlap
        if self.cycle is None:
            optimizer = self.optimizer
            assert optimizer is not None
            self.cycle = _Cycle(StepWorker(quick_gil=self.runs_on, threads=self._worker_threads()),
                                _hyper(optimizer.param_groups))
        if not self.cycle.has(engine):
            self.cycle.engines.append(engine)
        return self.cycle

    def _worker_threads(self) -> int:
        """The worker's intra-op width: with ``step="cpu"`` steps ``OffloadPolicy.step_threads``,
        by default one core fewer than the caller's (``spare_threads``: Adam is elementwise, so the
        same bits) while the backward runs, the caller's from ``optimizer.step()`` on (``finish``:
        the caller waits there, or with ``"forward"`` in the next forward's gathers); norms
        (``"clip"``, a reduction) and the streamed step keep the caller's."""
        width = torch.get_num_threads()
        if not (self.steps and self.policy.step == "cpu"):
            return width
        return self.policy.step_threads if self.policy.step_threads is not None else spare_threads(width)

    def _submit(self, cycle: _Cycle, engine: FSDPEngine, unit: FSDPUnit, event: Any) -> None:
        cycle.units.append(unit)
        decoupled = engine.config.use_decoupled_grad
        order = _forward_order(cycle, engine, unit)
        on_device = order % _MODEL_STRIDE < self.policy.device_step_units
        if self.steps:
            work: Callable[[], None] = lambda: self._step_unit(cycle, unit, decoupled, event, on_device)  # noqa: E731
        else:
            work = lambda: self._norms_of(cycle, unit, decoupled)  # noqa: E731

        label = f"FSDP::overlap_{'step' if self.steps else 'norms'} ({unit.name})"

        def task() -> None:
            start = time.perf_counter()
            with record_function(label):  # what a trace shows against the backward's compute
                wait_on_host(event)  # the unit's grads are in host memory
                cycle.times.add("grads", start)
                with current(self.device), torch.no_grad():
                    work()
            cycle.times.busy.append((start, time.perf_counter()))

        done = cycle.worker.submit(task, order)
        if self.runs_on:  # the next forward's gather of the unit waits for this task
            assert unit.offload is not None
            unit.offload.await_step = functools.partial(self._await_unit, cycle, done)

    def _await_unit(self, cycle: _Cycle, done: threading.Event) -> None:
        """``"forward"``: a gather of the next forward waits for its unit's step (main thread);
        a failed worker ends the running-on step, raising its error."""
        done.wait()
        if cycle.worker.failed and self.stepping is cycle:
            self.join_stepping()

    # --------------------------------------------------------------- the worker
    def _step_unit(self, cycle: _Cycle, unit: FSDPUnit, decoupled: bool, landed: Any, on_device: bool) -> None:
        """``overlap_step=True``: the unit's update (worker thread); with ``step="cpu"`` also the
        upload of its new weights to the device, made now instead of in the next forward
        (``UnitOffload.refresh_ahead``; ``landed``: the event of the unit's grad landing), or, for
        a unit of ``device_step_units`` (``on_device``), its step on the device."""
        from .device_step import device_step_unit
        from .optim import host_step_units, runner_of
        optimizer = self.optimizer
        if optimizer is None:
            return
        grad_of = _grad_reader(decoupled)
        if on_device:
            since = time.perf_counter()
            cycle.downloads.append(device_step_unit(optimizer, unit, grad_of, cycle.snapshot, self.device_stream,
                                                    landed))
            cycle.times.add("device_step", since)
            return
        if self.policy.step == "cpu":  # with the hyper-parameters of the cycle's start (checked at step())
            times, start = cycle.times, time.perf_counter()
            host_step_units(optimizer, [unit], grad_of, cycle.snapshot)
            since = times.add("step", start)
            times.stepped.append((start, since, sum(local_tensor(mp.sharded).numel() for mp in unit.trainable)))
            assert unit.offload is not None
            unit.offload.refresh_host_copy()
            since = times.add("host_copy", since)
            unit.offload.refresh_ahead(self.stream, landed)
            times.add("upload", since)
            return
        engines = list(optimizer._fsdp_engines)  # type: ignore[attr-defined]
        runner = runner_of(optimizer, engines, self.policy, self.device)
        with self.stream.enter():  # ordered by the host wait for the grads' copy
            runner.step(only=[unit], grad_of=grad_of)

    def _norms_of(self, cycle: _Cycle, unit: FSDPUnit, decoupled: bool) -> None:
        """``overlap_step="clip"``: the 2-norm of each of the unit's grads as ``clip_grad_norm``
        reads them (the installed value: a cast copy when the grad dtype differs), in the
        accumulation dtype ``clip_grad_norm`` would pick (worker thread)."""
        grad_of = _grad_reader(decoupled)
        named = [(id(mp.sharded), grad_of(unit, mp)) for mp in unit.trainable]
        named = [(key, g) for key, g in named if g.numel() > 0]
        if not named:
            return
        dtype = self.norm_dtype(unit)
        for (key, _), norm in zip(named, torch._foreach_norm([g for _, g in named], 2.0, dtype=dtype), strict=True):
            cycle.norms[key] = norm

    @staticmethod
    def norm_dtype(unit: FSDPUnit) -> torch.dtype:
        """``clip_grad._acc_dtype`` for grads of this unit's kind: fp64 only for fp64 grads."""
        return torch.float64 if unit.offload is not None and unit.offload.host_grad is not None and \
            unit.offload.host_grad.dtype == torch.float64 else torch.float32

    # ------------------------------------------------------------- optimizer.step
    def pending_steps(self) -> bool:
        """An ``overlap_step=True`` cycle that stepped units and awaits ``optimizer.step()``."""
        return self.steps and self.cycle is not None

    def finish(self) -> None:
        """``optimizer.step()`` after an ``overlap_step=True``/``"forward"`` backward: refuse what
        changed since the backward, re-raise a failure, consume the cycle. ``True`` first waits
        for the units' steps; ``"forward"`` lets the worker run on, first unit first
        (``stepping``), until the next forward's gathers or ``join_stepping``."""
        cycle = self.cycle
        assert cycle is not None
        self.cycle = None
        if self.steps and self.policy.step == "cpu" and self.policy.step_threads is None:
            # the caller only waits from here (True: in step(); "forward": in the next forward's
            # gathers, which trail the units still to step): those units take its core too
            cycle.worker.widen(torch.get_num_threads())
        if not self.runs_on:
            try:
                cycle.worker.join()
                for event in cycle.downloads:  # device_step_units: host state is final after step()
                    wait_on_host(event)
            finally:
                self._ended(cycle)
        try:
            self._check_consumable(cycle)
        except BaseException:
            if self.runs_on:
                cycle.worker.join_after_failure()
                self._ended(cycle)
            raise
        if self.runs_on:
            cycle.worker.by_unit_order()
            self.stepping = cycle

    def _check_consumable(self, cycle: _Cycle) -> None:
        optimizer = self.optimizer
        assert optimizer is not None
        mode = f"OffloadPolicy(overlap_step={self.mode!r})"
        if not cycle.finished:
            raise RuntimeError(f"optimizer.step() ran inside a backward with {mode}; call it after the backward")
        for attr in ("grad_scale", "found_inf"):
            if getattr(optimizer, attr, None) is not None:
                raise RuntimeError(f"optimizer.{attr} is set (a GradScaler step): {mode} stepped during the backward, "
                                   "before the scaler could unscale or skip; use overlap_step=False")
        for i, (then, now) in enumerate(zip(cycle.snapshot, _hyper(optimizer.param_groups), strict=False)):
            changed = sorted(k for k in set(then) | set(now) if not _same(then.get(k), now.get(k)))
            if changed:
                raise RuntimeError(f"param group {i}'s {changed} changed between the backward and optimizer.step(): "
                                   f"with {mode} each unit stepped during the backward with "
                                   "the values of then; change them before the backward (e.g. scheduler.step() "
                                   "right after optimizer.step()), or use overlap_step=False")
        for data, version in cycle.grad_marks:
            if data._version != version:
                raise RuntimeError(f"the grads were changed in place between the backward and optimizer.step(): with "
                                   f"{mode} the units stepped on the grads as they landed; "
                                   "use overlap_step='clip' to clip, or overlap_step=False")

    def _ended(self, cycle: _Cycle) -> None:
        cycle.times.step_end = time.perf_counter()
        self.last_times = cycle.times

    def join_stepping(self) -> None:
        """``"forward"``: wait for the units of the last ``optimizer.step()`` that still step, and
        re-raise the worker's failure (no-op when none runs on)."""
        cycle, self.stepping = self.stepping, None
        if cycle is None:
            return
        for unit in cycle.units:
            if unit.offload is not None:
                unit.offload.await_step = None
        try:
            cycle.worker.join()
        finally:
            self._ended(cycle)

    def close(self) -> None:
        """Join and drop the open cycle (``"clip"``: before the step or a new backward; the
        steps were never started), after the units of a step still running on (``"forward"``)."""
        self.join_stepping()
        cycle, self.cycle = self.cycle, None
        if cycle is not None:
            try:
                cycle.worker.join()
            finally:
                self._ended(cycle)

    # ------------------------------------------------------------------ guards
    def _refuse(self, message: str) -> NoReturn:
        """Abandon the open ``overlap_step=True`` cycle (its worker joined, so no thread writes
        on) and raise ``message``, chained to the worker's own failure if it had one."""
        assert self.cycle is not None
        worker, self.cycle = self.cycle.worker, None
        worker.join_after_failure()
        raise RuntimeError(message) from worker.failure

    def before_forward(self, engine: FSDPEngine) -> None:
        """The next forward of ``engine`` would read weights an ``overlap_step=True`` cycle is
        writing (the forward of another model sharing the optimizer may run). ``"forward"``
        after ``step()``: each unit's gather waits for its step, where every unit gathers from
        its host shard in each forward (ZeRO-3 without FP8 params); otherwise wait for all now."""
        if self.stepping is not None and self.stepping.has(engine) and not _gathers_every_forward(engine):
            self.join_stepping()
        if self.pending_steps():
            assert self.cycle is not None
            if not self.cycle.has(engine):
                return
            self._refuse(f"a forward ran after a backward with OffloadPolicy(overlap_step={self.mode!r}) but before "
                         "optimizer.step(): the params were already updated on that backward's grads; call "
                         "optimizer.step() after every sync backward (or use overlap_step=False)")

    def before_zero_grad(self, free: bool = True) -> None:
        """``zero_grad`` would reset host grads the worker may still read (``free=False`` zeroes
        them: it waits for a step running on; ``True`` only drops the ``.grad`` views)."""
        if not free:
            self.join_stepping()
        if self.cycle is None:
            return
        if self.steps:
            self._refuse(f"zero_grad() ran after a backward with OffloadPolicy(overlap_step={self.mode!r}) but before "
                         "optimizer.step(): the units already stepped on those grads, they cannot be dropped; "
                         "call optimizer.step() first (or use overlap_step=False to skip steps)")
        self.close()

    def norms_for_clip(self) -> Callable[[torch.Tensor, float, torch.dtype], torch.Tensor | None]:
        """``clip_grad_norm``: refuse after an ``overlap_step=True`` backward; with ``"clip"``,
        wait for the norms and return a lookup of a local grad's precomputed norm (None when it
        is not one of this backward's grads, changed since, or asked in another norm/dtype)."""
        self.join_stepping()
        cycle = self.cycle
        if cycle is None:
            return _no_norm
        if self.steps:
            raise RuntimeError(f"clip_grad_norm after a backward with OffloadPolicy(overlap_step={self.mode!r}): the "
                               "optimizer "
                               "already stepped each unit as its grads landed, so clipping now would scale grads that "
                               "were already applied; use OffloadPolicy(overlap_step='clip') (grad copies and norms "
                               "overlap the backward, the step waits for the norm) or overlap_step=False")
        cycle.worker.join()  # the norms are complete after it (join may be called again)

        def lookup(t: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor | None:
            mark = cycle.norm_marks.get(id(t))
            if norm_type != 2.0 or mark is None or mark[0] is not t or mark[1] != t._version:
                return None
            norm = cycle.norms.get(mark[2])
            if norm is None or norm.dtype != dtype:
                return None
            cycle.times.norm_hits += 1
            return norm

        return lookup


def _no_norm(t: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor | None:
    return None


def _forward_order(cycle: _Cycle, engine: FSDPEngine, unit: FSDPUnit) -> int:
    """Where ``unit`` comes in the next forward: the models of the cycle in order, in each the
    root first (it gathers at the model's start; ``engine.units`` lists it last), then the units."""
    position = -1 if unit is engine.root else next(i for i, u in enumerate(engine.units) if u is unit)
    model = next(i for i, e in enumerate(cycle.engines) if e is engine)
    return model * _MODEL_STRIDE + position + 1


def _gathers_every_forward(engine: FSDPEngine) -> bool:
    """Every offloaded unit of ``engine`` reads its host shard through ``UnitOffload.gather_source``
    in each forward (ZeRO-3 without FP8 params), so a per-unit wait there covers the forward."""
    return all(u.ctx.zero3 and u.fp8 is None for u in engine.units if u.offload is not None)


def _grad_reader(decoupled: bool) -> Callable[[FSDPUnit, ManagedParam], torch.Tensor]:
    """A unit param's grad from the host buffer, as ``GradViews.install`` will show it: the
    view itself, or (``.grad`` of another dtype than the param) the cast copy's values."""

    def grad_of(unit: FSDPUnit, mp: ManagedParam) -> torch.Tensor:
        assert unit.offload is not None and unit.offload.host_grad is not None
        view = unit.offload.host_grad.local_view(mp.grad_slot)
        local = mp.sharded_local()
        return view if decoupled or view.dtype == local.dtype else view.to(local.dtype)

    return grad_of


def clip_norm_lookup(params: list[torch.Tensor]) -> Callable[[torch.Tensor, float, torch.dtype], torch.Tensor | None]:
    """For ``clip_grad_norm``: the precomputed-norm lookup of the overlapped models ``params``
    belong to (or one that finds nothing); raises after an ``overlap_step=True`` backward."""
    from ..engine import ENGINE_REF_ATTR
    controllers: list[OverlappedStep] = []
    seen: list[Any] = []
    for p in params:
        ref = getattr(p, ENGINE_REF_ATTR, None)
        engine = ref() if ref is not None else None
        if engine is None or any(engine is e for e in seen):
            continue
        seen.append(engine)
        overlap = engine.offload.overlap if engine.offload is not None else None
        if overlap is not None and all(overlap is not c for c in controllers):
            controllers.append(overlap)
    lookups = [c.norms_for_clip() for c in controllers]
    if not lookups:
        return _no_norm

    def lookup(t: torch.Tensor, norm_type: float, dtype: torch.dtype) -> torch.Tensor | None:
        for one in lookups:
            found = one(t, norm_type, dtype)
            if found is not None:
                return found
        return None

    return lookup


def attach_overlap(optimizer: torch.optim.Optimizer, engines: list[FSDPEngine], policy: OffloadPolicy) -> None:
    """Give ``optimizer`` its overlap controller and the engines a reference to it (binding)."""
    from .optim import OVERLAP_ATTR
    if policy.overlap_step is False:
        return
    overlap = optimizer.__dict__.get(OVERLAP_ATTR)
    if overlap is None:
        overlap = OverlappedStep(optimizer, policy, engines[0].ctx.device)
        optimizer.__dict__[OVERLAP_ATTR] = overlap
        # "forward": reading or loading the optimizer state waits for a step still running on
        optimizer.register_state_dict_pre_hook(_join_before_state_dict)
        optimizer.register_load_state_dict_pre_hook(_join_before_load)
    for engine in engines:
        if engine.offload is not None:
            engine.offload.overlap = overlap


def _join_before_state_dict(optimizer: torch.optim.Optimizer) -> None:
    wait_for_step(optimizer)


def _join_before_load(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    wait_for_step(optimizer)


def wait_for_step(optimizer: torch.optim.Optimizer) -> None:
    """``OffloadPolicy(overlap_step="forward")``: return once every unit of the last
    ``optimizer.step()`` has stepped (the params and optimizer state are final), re-raising a
    failure of the host step; a no-op for any other optimizer or when nothing runs on."""
    from .optim import OVERLAP_ATTR
    overlap = optimizer.__dict__.get(OVERLAP_ATTR)
    if isinstance(overlap, OverlappedStep):
        overlap.join_stepping()


def wait_for_model_step(engine: FSDPEngine) -> None:
    """``wait_for_step`` for the optimizer bound to ``engine`` (the model's state-dict hooks)."""
    if engine.offload is not None and engine.offload.overlap is not None:
        engine.offload.overlap.join_stepping()


def hidden_share(times: OverlapTimes | None) -> float | None:
    """The share of the last cycle's worker time hidden under the backward (bench)."""
    return times.hidden_share() if times is not None else None


__all__ = ["OverlapTimes", "OverlappedStep", "StepWorker", "attach_overlap", "clip_norm_lookup", "hidden_share",
           "wait_for_model_step", "wait_for_step"]
