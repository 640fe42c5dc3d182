"""The optimizer side of CPU offload (``OffloadPolicy``): which optimizers each step mode runs,
the host step, and the streamed step's Adam kernels and state buffers.

* ``step="cpu"``: the user's optimizer steps on the host tensors after the device is
  synchronised (the grads' device-to-host copies are done and no copy still reads the host
  weights). ``torch.optim.Adam/AdamW`` and ``fsdp_impl.optim.Adam/AdamW`` param groups that left
  both ``fused`` and ``foreach`` at None run torch's fused CPU kernel (``prepare_host_step``).
* ``step="gpu"``: ``OffloadedAdamStep`` replaces the optimizer's ``step``: it creates the state
  as the optimizer would (its own lazy init), moves it into one flat buffer per unit and state
  key (host memory, pinned), and runs ``step.StreamedStep`` with a kernel that calls the
  optimizer's own update function (``torch.optim.adam.adam`` with the group's flags, or
  ``fsdp_impl.optim``'s path choice) on each chunk's views. The math, flags and kernel choice
  are those of the non-offloaded step, so the result is bit-identical to it. Each parameter's
  step counter goes into the kernel as a copy holding the pre-step value (the kernel increments
  it; a parameter split over chunks must not count several steps) and is incremented once after.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import increment_version
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import _get_scalar_dtype  # Adam's step-counter dtype (torch's own rule)

from ..decoupled import read_grad
from ..device import host_device, host_zeros, synchronize
from ..graph_mode import USER_CLASS_ATTR
from ..optim import Adam as FsdpAdam
from ..optim import AdamW as FsdpAdamW
from ..optim._adam_math import AdamTensors
from ..optim.adam import step_group
from ..placement import local_tensor
from .host import OffloadPolicy
from .step import GRAD, PARAM, STATE_KINDS, ChunkKind, StepStreams, StreamedStep, StreamEntry

# How the optimizer's overlap controller is kept (``optimizer.__dict__``; overlap.py sets it)
OVERLAP_ATTR = "_fsdp_offload_overlap"
# A unit param's grad as the optimizer would read it (overlap: before the grads are installed)
GradOf = Callable[["FSDPUnit", "ManagedParam"], torch.Tensor]

if TYPE_CHECKING:
    from ..engine import FSDPEngine
    from ..param import ManagedParam
    from ..unit import FSDPUnit
    from .overlap import OverlappedStep

_RUNNER_ATTR = "_fsdp_offload_step"


def user_class(optimizer: torch.optim.Optimizer) -> type:
    """The user's optimizer class (``fully_shard`` swaps in a subclass; look through it)."""
    return getattr(type(optimizer), USER_CLASS_ATTR, type(optimizer))


def _is_torch_adam(cls: type) -> bool:
    return cls in (torch.optim.Adam, torch.optim.AdamW)


def _is_fsdp_adam(cls: type) -> bool:
    return cls in (FsdpAdam, FsdpAdamW)


def check_offload_optimizer(policy: OffloadPolicy | None, optimizer: torch.optim.Optimizer) -> None:
    """``step="gpu"`` and ``overlap_step=True`` run Adam/AdamW only: any other optimizer (or a
    subclass, whose own ``step`` would be bypassed) is refused naming ``offload_policy`` and the class."""
    if not isinstance(policy, OffloadPolicy):
        return
    cls = user_class(optimizer)
    if policy.steps_in_backward and not (_is_torch_adam(cls) or _is_fsdp_adam(cls)):
        raise ValueError(f"offload_policy=OffloadPolicy(overlap_step={policy.overlap_step!r}) steps Adam/AdamW "
                         f"unit by unit (fsdp_impl.optim.Adam/AdamW, torch.optim.Adam/AdamW), but the optimizer is "
                         f"{cls.__module__}.{cls.__qualname__}; use overlap_step='clip' or False for other optimizers")
    if policy.steps_in_backward:
        for i, group in enumerate(optimizer.param_groups):
            if group.get("differentiable", False):
                raise ValueError(f"offload_policy=OffloadPolicy(overlap_step={policy.overlap_step!r}) cannot step "
                                 f"a differentiable {cls.__name__} unit by unit (param group {i} has "
                                 "differentiable=True)")
    if policy.step != "gpu":
        return
    if not (_is_torch_adam(cls) or _is_fsdp_adam(cls)):
        raise ValueError(f"offload_policy=OffloadPolicy(step='gpu') streams the state of Adam/AdamW only "
                         f"(fsdp_impl.optim.Adam/AdamW, torch.optim.Adam/AdamW), but the optimizer is "
                         f"{cls.__module__}.{cls.__qualname__}; use OffloadPolicy(step='cpu') to run any optimizer "
                         "on the host")
    for i, group in enumerate(optimizer.param_groups):
        if group.get("differentiable", False):
            raise ValueError(f"offload_policy=OffloadPolicy(step='gpu') cannot stream a differentiable "
                             f"{cls.__name__} (param group {i} has differentiable=True)")


def prepare_host_step(optimizer: torch.optim.Optimizer, policy: OffloadPolicy) -> None:
    """``step="cpu"``: Adam/AdamW groups that chose neither ``fused`` nor ``foreach`` run torch's
    fused CPU kernel (one pass over param, grad and moments) instead of the single-tensor loop
    torch picks on the CPU. ``fsdp_impl.optim`` groups with moments narrower than the params
    cannot use it and keep their path."""
    if policy.step != "cpu":
        return
    cls = user_class(optimizer)
    if not (_is_torch_adam(cls) or _is_fsdp_adam(cls)) or not hasattr(torch, "_fused_adam_"):
        return
    narrow = _is_fsdp_adam(cls) and (getattr(optimizer, "exp_avg_dtype", None) is not None
                                     or getattr(optimizer, "exp_avg_sq_dtype", None) is not None)
    for group in optimizer.param_groups:
        if group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable"):
            if not narrow and all(p.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
                                  for p in group["params"]):
                group["fused"] = True


def offload_policy_of(engines: list[FSDPEngine]) -> OffloadPolicy | None:
    """The one offload policy of the models an optimizer steps (None: none offloads); models
    with different policies (or offloaded and not) cannot share an optimizer."""
    offloads = [getattr(e, "offload", None) for e in engines]
    policies = [o.policy if o is not None else None for o in offloads]
    if not policies or all(p is None for p in policies):
        return None
    if any(p != policies[0] for p in policies):
        raise ValueError(f"one optimizer steps models with different offload_policy values ({policies}); wrap them "
                         "with the same offload_policy or give each its own optimizer")
    return policies[0]


def offloaded_step(optimizer: torch.optim.Optimizer, engines: list[FSDPEngine], own_step: Callable[..., Any],
                   *args: Any, **kwargs: Any) -> Any:
    """``optimizer.step`` of an optimizer bound to offloaded models."""
    policy = offload_policy_of(engines)
    if policy is None:
        return own_step(*args, **kwargs)
    overlap = overlap_of(optimizer)
    if overlap is not None and overlap.pending_steps():  # overlap_step=True: the units stepped already
        return _hooked_overlap_step(optimizer, *args, **kwargs)
    if overlap is not None:
        overlap.close()  # overlap_step="clip" (or nothing pending): the grads' copies and norms are done
    device = engines[0].ctx.device
    if policy.step == "cpu":
        synchronize(device)  # grads copied down, no copy still reading the host weights
        return own_step(*args, **kwargs)  # the bound optimizer's step tells the engines (note_optimizer_step)
    runner_of(optimizer, engines, policy, device)
    return _hooked_streamed_step(optimizer, *args, **kwargs)


def runner_of(optimizer: torch.optim.Optimizer, engines: list[FSDPEngine], policy: OffloadPolicy,
              device: torch.device) -> OffloadedAdamStep:
    """The streamed step of ``optimizer`` (``step="gpu"``), made at its first use or when models
    were bound since."""
    runner = optimizer.__dict__.get(_RUNNER_ATTR)
    if runner is None or runner.engines != engines:
        runner = OffloadedAdamStep(optimizer, list(engines), policy, device)
        optimizer.__dict__[_RUNNER_ATTR] = runner
    return runner


def overlap_of(optimizer: torch.optim.Optimizer) -> OverlappedStep | None:
    """The overlap controller of ``optimizer`` (``OffloadPolicy.overlap_step``), or None."""
    return optimizer.__dict__.get(OVERLAP_ATTR)


def _overlap_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """``overlap_step=True``: what is left of a step whose units stepped during the backward."""
    overlap = overlap_of(optimizer)
    assert overlap is not None
    if closure is not None:
        raise ValueError("optimizer.step(closure) cannot follow a backward with OffloadPolicy(overlap_step=True): "
                         "the units already stepped on that backward's grads; run the closure's backward "
                         "before step() or use overlap_step=False")
    overlap.finish()
    return None


def _streamed_step(optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> Any:
    """``step="gpu"``: the closure (if any), then the streamed step in place of the optimizer's
    (called with the arguments of ``optimizer.step``, so step hooks see what they expect)."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    optimizer.__dict__[_RUNNER_ATTR].step()
    return loss


# torch's step wrapper: the optimizer's step pre/post hooks (and the global ones) and the profiler
# label run around the streamed step exactly as around the optimizer's own step.
_hooked_streamed_step = torch.optim.Optimizer.profile_hook_step(_streamed_step)
_hooked_overlap_step = torch.optim.Optimizer.profile_hook_step(_overlap_step)


def mark_weights_changed(engines: list[FSDPEngine]) -> None:
    """The streamed step updated the weights (``FSDPEngine.note_optimizer_step``)."""
    for engine in engines:
        engine.note_optimizer_step()


class OffloadedAdamStep:
    """The streamed Adam/AdamW step of one optimizer (``step="gpu"``)."""

    def __init__(self, optimizer: torch.optim.Optimizer, engines: list[FSDPEngine], policy: OffloadPolicy,
                 device: torch.device, streams: StepStreams | None = None) -> None:
        self.optimizer = optimizer
        self.policy = policy
        self.device = device
        self.cls = user_class(optimizer)
        self.owner: dict[int, tuple[FSDPUnit, ManagedParam]] = {}
        for engine in engines:
            for unit in engine.units:
                for mp in unit.trainable:
                    self.owner[id(mp.sharded)] = (unit, mp)
        self.arenas: dict[tuple[int, ChunkKind, torch.dtype], torch.Tensor] = {}
        self.offsets: dict[int, list[int]] = {}  # per unit: each trainable param's offset in its arenas
        streamed = set(STATE_KINDS) if policy.optimizer_state else set()
        streamed |= {PARAM} if policy.main_params else set()
        streamed |= {GRAD} if policy.grads_on_host else set()
        self.engines = engines
        self.core = StreamedStep(device, streamed, policy.chunk_bytes, policy.pin_memory,
                                 streams or StepStreams.for_device(device))

    # ---------------------------------------------------------------------- step
    def step(self, only: list[FSDPUnit] | None = None, grad_of: GradOf | None = None) -> None:
        """One streamed step: of every param with a grad, or (``overlap_step``) of the params of
        the units ``only``, their grads read with ``grad_of``, the weights marked changed per unit."""
        entries, units = self._entries(only, grad_of)
        fresh = [u for u in units if u.offload is not None and u.offload.shard_is_fresh()]
        for entry in entries:  # only fresh compute shards are kept fresh; stale ones refresh at the gather
            unit = entry.extra["unit"]
            if not any(unit is u for u in fresh):
                entry.compute = None
        self._stage_steps(entries)
        kernel = self._torch_kernel if _is_torch_adam(self.cls) else self._fsdp_kernel
        self.core.run(entries, kernel)
        with torch.no_grad():
            for entry in entries:
                entry.extra["step"].add_(1)
        if only is None:
            mark_weights_changed(self.engines)
        else:
            for unit in units:
                increment_version(unit.weight.data)  # what note_optimizer_step does, for this unit
        for unit in fresh:
            assert unit.offload is not None
            unit.offload.mark_shard_fresh()

    def _entries(self, only: list[FSDPUnit] | None = None, grad_of: GradOf | None = None
                 ) -> tuple[list[StreamEntry], list[FSDPUnit]]:
        """One entry per param with a grad (of the units ``only``, if given), in param-group
        order, its state created and adopted."""
        entries: list[StreamEntry] = []
        units: list[FSDPUnit] = []
        decoupled = bool(getattr(self.optimizer, "use_decoupled_grad", False))
        for gi, group in enumerate(self.optimizer.param_groups):
            for p in group["params"]:
                owner = self.owner.get(id(p))
                if only is not None and (owner is None or all(owner[0] is not u for u in only)):
                    continue
                grad = read_grad(p, decoupled) if grad_of is None or owner is None else grad_of(*owner)
                if grad is None:
                    continue
                if owner is None:
                    raise ValueError("offload_policy: the optimizer holds a parameter that is not a trainable "
                                     "parameter of an offloaded model")
                if torch.is_complex(p) or grad.is_sparse:
                    raise ValueError("offload_policy=OffloadPolicy(step='gpu') supports dense real parameters "
                                     "and grads only")
                unit, mp = self.owner[id(p)]
                state = self.optimizer.state[p]
                if len(state) == 0:
                    self._init_state(group, p, unit, mp)
                tensors = {PARAM: local_tensor(p).view(-1), GRAD: local_tensor(grad).reshape(-1)}
                for key in STATE_KINDS:
                    if key in state:
                        tensors[key] = self._adopt(unit, mp, state, key)
                compute = unit.offload.compute_view(unit.params.index(mp)) if unit.offload else None
                entries.append(StreamEntry(gi, tensors, compute, {"step": state["step"], "unit": unit,
                                                                   "device_step": _device_step(group)}))
                if all(u is not unit for u in units):
                    units.append(unit)
        return entries, units

    def _init_state(self, group: dict[str, Any], p: torch.Tensor, unit: FSDPUnit, mp: ManagedParam) -> None:
        """The state the optimizer's lazy init would create (same keys, dtypes and step counter),
        with the moments zeroed in place in the unit's flat buffers: creating them where the
        optimizer would (next to the param) and copying them over would briefly need a second
        copy, on the device when the main params stay there."""
        state = self.optimizer.state[p]
        fused, capturable = bool(group.get("fused")), bool(group.get("capturable"))
        param_device = local_tensor(p).device
        if _is_torch_adam(self.cls):
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=param_device)
                             if fused or capturable else torch.tensor(0.0, dtype=_get_scalar_dtype()))
        else:
            state["step"] = (torch.zeros((), dtype=torch.float32, device=param_device) if fused or capturable
                             else torch.tensor(0.0, dtype=torch.float32))
        for key in STATE_KINDS if group["amsgrad"] else STATE_KINDS[:2]:
            dtype = self.optimizer._moment_dtype(key, p) if _is_fsdp_adam(self.cls) else p.dtype  # type: ignore[attr-defined]
            view = self._arena(unit, key, dtype)[self._span(unit, mp)]
            view.zero_()
            state[key] = unit.ctx.plan.wrap(view.view(local_tensor(p).shape), mp.tp, mp.shape)

    def _adopt(self, unit: FSDPUnit, mp: ManagedParam, state: dict[str, Any], key: ChunkKind) -> torch.Tensor:
        """Param ``mp``'s ``state[key]`` as a view of the unit's flat buffer for ``key`` (host
        memory with ``optimizer_state``, else the device); a state tensor the optimizer (or a
        ``load_state_dict``) made elsewhere is copied in and replaced by the view."""
        value = state[key]
        local = local_tensor(value)
        arena = self._arena(unit, key, local.dtype)
        view = arena[self._span(unit, mp)]
        same_storage = local.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
        if local.data_ptr() != view.data_ptr() or not same_storage:
            with torch.no_grad():
                view.copy_(local.reshape(-1))
            shaped = view.view(local.shape)
            state[key] = unit.ctx.plan.wrap(shaped, mp.tp, mp.shape) if isinstance(value, DTensor) else shaped
        return view

    def _span(self, unit: FSDPUnit, mp: ManagedParam) -> slice:
        """Where param ``mp``'s state lies in its unit's flat state buffers."""
        offsets = self._offsets(unit)
        return slice(offsets[mp.grad_slot], offsets[mp.grad_slot + 1])

    def _offsets(self, unit: FSDPUnit) -> list[int]:
        offsets = self.offsets.get(id(unit))
        if offsets is None:
            offsets, total = [], 0
            for q in unit.trainable:
                offsets.append(total)
                total += q.sharded_local().numel()
            offsets.append(total)
            self.offsets[id(unit)] = offsets
        return offsets

    def _arena(self, unit: FSDPUnit, key: ChunkKind, dtype: torch.dtype) -> torch.Tensor:
        name = (id(unit), key, dtype)
        arena = self.arenas.get(name)
        if arena is None:
            numel = self._offsets(unit)[-1]
            if not self.policy.optimizer_state:
                arena = torch.zeros(numel, dtype=dtype, device=self.device)
            else:
                arena = host_zeros(numel, dtype, self.policy.pin_memory, self.policy.huge_pages)
            self.arenas[name] = arena
        return arena

    def _stage_steps(self, entries: list[StreamEntry]) -> None:
        """Pre-step counters where the kernel needs them: on the window's device for fused or
        capturable groups (one copy for all), else the host counter itself."""
        on_device = [e for e in entries if e.extra["device_step"]]
        if on_device:
            stacked = torch.stack([e.extra["step"].detach().reshape(()) for e in on_device]).to(self.device)
            for j, entry in enumerate(on_device):
                entry.extra["staged"] = stacked[j]
        for entry in entries:
            entry.extra.setdefault("staged", entry.extra["step"])

    # ------------------------------------------------------------------- kernels
    def _torch_kernel(self, gi: int, items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]]) -> None:
        torch_kernel(self.optimizer, self.cls, gi, items)

    def _fsdp_kernel(self, gi: int, items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]]) -> None:
        fsdp_kernel(self.optimizer, gi, items)


def user_kernel(optimizer: torch.optim.Optimizer, cls: type, gi: int,
                items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]], values: dict[str, Any]) -> None:
    """The update of the optimizer's class (``cls``: torch's Adam/AdamW or ``fsdp_impl.optim``'s)
    on ``items``' views, wherever they lie (host step, device step), with ``values``."""
    if _is_torch_adam(cls):
        torch_kernel(optimizer, cls, gi, items, values)
    else:
        fsdp_kernel(optimizer, gi, items, values)


def torch_kernel(optimizer: torch.optim.Optimizer, cls: type, gi: int,
                 items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]],
                 values: dict[str, Any] | None = None) -> None:
    """``torch.optim.adam.adam`` with the group's flags, as ``torch.optim.Adam.step`` calls it
    (``values``: the hyper-parameters to use instead of the live group's)."""
    group = values if values is not None else optimizer.param_groups[gi]
    beta1, beta2 = group["betas"]
    amsgrad = group["amsgrad"]
    fn = _torch_adam_fn(bool(group.get("decoupled_weight_decay", issubclass(cls, torch.optim.AdamW))))
    fn([v[PARAM] for _, v in items], [v[GRAD] for _, v in items], [v["exp_avg"] for _, v in items],
       [v["exp_avg_sq"] for _, v in items], [v["max_exp_avg_sq"] for _, v in items] if amsgrad else [],
       [_step_copy(e) for e, _ in items], amsgrad=amsgrad, has_complex=False, beta1=beta1, beta2=beta2,
       lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
       foreach=group["foreach"], capturable=group["capturable"], differentiable=group["differentiable"],
       fused=group["fused"], grad_scale=getattr(optimizer, "grad_scale", None),
       found_inf=getattr(optimizer, "found_inf", None))


def fsdp_kernel(optimizer: torch.optim.Optimizer, gi: int,
                items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]],
                values: dict[str, Any] | None = None) -> None:
    """``fsdp_impl.optim.Adam.step``'s path choice (fused / foreach / single) on the views."""
    group = values if values is not None else optimizer.param_groups[gi]
    batch = [AdamTensors(param=v[PARAM], grad=v[GRAD], exp_avg=v["exp_avg"], exp_avg_sq=v["exp_avg_sq"],
                         max_exp_avg_sq=v.get("max_exp_avg_sq") if group["amsgrad"] else None,
                         step=_step_copy(e)) for e, v in items]
    step_group(group, batch)


def host_step_units(optimizer: torch.optim.Optimizer, units: list[FSDPUnit], grad_of: GradOf,
                    hyper: list[dict[str, Any]] | None = None) -> None:
    """``step="cpu"`` with ``overlap_step``: the optimizer's update of the params of ``units``
    on their host tensors, each param group's params in one kernel call, the lazy state made as
    the optimizer's own step makes it. Adam is elementwise per param (each has its own step
    counter), so stepping the params unit by unit gives the numbers of one step over all.
    ``hyper``: each group's hyper-parameters to step with (the values of the cycle's start; the
    live groups may have moved on, e.g. a scheduler after ``step()`` with ``"forward"``)."""
    cls = user_class(optimizer)
    owned = {id(mp.sharded): (unit, mp) for unit in units for mp in unit.trainable}
    for gi, group in enumerate(optimizer.param_groups):
        items: list[tuple[StreamEntry, dict[ChunkKind, torch.Tensor]]] = []
        for p in group["params"]:
            if id(p) not in owned:
                continue
            unit, mp = owned[id(p)]
            state = optimizer.state[p]
            if len(state) == 0:
                _init_host_state(optimizer, cls, group, p, unit, mp)
            views: dict[ChunkKind, torch.Tensor] = {PARAM: local_tensor(p)}
            views[GRAD] = grad_of(unit, mp).view(views[PARAM].shape)
            for key in STATE_KINDS:
                if key in state:
                    views[key] = local_tensor(state[key])
            items.append((StreamEntry(gi, views, None, {"step": state["step"], "staged": state["step"]}), views))
        if items:
            values = hyper[gi] if hyper is not None else group
            user_kernel(optimizer, cls, gi, items, values)
            for entry, _ in items:
                entry.extra["step"].add_(1)
    for unit in units:
        increment_version(unit.weight.data)  # what note_optimizer_step does, for this unit


def _init_host_state(optimizer: torch.optim.Optimizer, cls: type, group: dict[str, Any], p: torch.Tensor,
                     unit: FSDPUnit, mp: ManagedParam) -> None:
    """The state the optimizer's own lazy init makes for ``p`` (torch's ``Adam._init_group``,
    ``fsdp_impl.optim.Adam._init_state``): same keys, dtypes, devices and DTensor moments; torch's
    moments in huge pages with ``OffloadPolicy.huge_pages`` (``host_zeros_like``)."""
    if _is_fsdp_adam(cls):
        optimizer._init_state(p, group)  # type: ignore[attr-defined]
        return
    state = optimizer.state[p]
    fused, capturable = bool(group["fused"]), bool(group["capturable"])
    state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=fused), device=p.device)
                     if capturable or fused else torch.tensor(0.0, dtype=_get_scalar_dtype(), device=host_device()))
    huge = _huge_pages(unit)
    for key in STATE_KINDS if group["amsgrad"] else STATE_KINDS[:2]:
        state[key] = (host_zeros_like(p, unit, mp, pin=False) if huge
                      else torch.zeros_like(p, memory_format=torch.preserve_format))


def _huge_pages(unit: FSDPUnit) -> bool:
    """Whether the unit's offload policy asks for its host buffers in huge pages."""
    return unit.offload is not None and unit.offload.policy.huge_pages


def host_zeros_like(like: torch.Tensor, unit: FSDPUnit, mp: ManagedParam, pin: bool) -> torch.Tensor:
    """``zeros_like(like)`` (param ``mp``'s host tensor or moment, maybe a DTensor) from
    ``device.host_zeros``: page-locked with ``pin``, in huge pages as the unit's policy asks."""
    local = local_tensor(like)
    fresh = host_zeros(local.numel(), local.dtype, pin, _huge_pages(unit)).view(local.shape)
    return unit.ctx.plan.wrap(fresh, mp.tp, mp.shape) if isinstance(like, DTensor) else fresh


def _device_step(group: dict[str, Any]) -> bool:
    """Fused and capturable Adam keep the step counter next to the params (here: the window)."""
    return bool(group.get("fused")) or bool(group.get("capturable"))


def _step_copy(entry: StreamEntry) -> torch.Tensor:
    """A fresh counter with the pre-step value for one piece (the kernel increments it)."""
    return entry.extra["staged"].clone()


@functools.cache
def _torch_adam_fn(decoupled: bool) -> Callable[..., None]:
    """torch's functional Adam; AdamW through ``decoupled_weight_decay`` where ``adam`` takes it
    (torch >= 2.7), else ``torch.optim.adamw.adamw``."""
    from torch.optim.adam import adam
    if "decoupled_weight_decay" in inspect.signature(adam).parameters:
        return functools.partial(adam, decoupled_weight_decay=decoupled)
    if decoupled:  # pragma: no cover - older torch
        from torch.optim.adamw import adamw
        return adamw
    return adam  # pragma: no cover - older torch


__all__ = ["OffloadedAdamStep", "check_offload_optimizer", "host_step_units", "offloaded_step", "prepare_host_step",
           "runner_of"]
