"""Bind the user's optimizer to a wrapped model: remap its param groups onto the DTensor shards
and make ``zero_grad`` reset the FSDP grad buffers too.

The optimizer object keeps its class behaviour, hyper-parameters and param groups; its class is
swapped for a one-off subclass that adds the buffer reset (``isinstance`` checks keep working).
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from .decoupled import clear_grads
from .engine import ENGINE_REF_ATTR as ENGINE_REF_ATTR  # re-exported: where it was defined before
from .engine import FSDPEngine
from .graph_mode import USER_CLASS_ATTR, check_optimizer_capturable
from .local_step import LocalShardStep, eligible_class
from .offload.optim import check_offload_optimizer, offload_policy_of, offloaded_step, prepare_host_step
from .offload.overlap import attach_overlap
from .placement import local_tensor
from .traceable import traceable_zero_grad


def param_mapping(model: torch.nn.Module) -> dict[int, torch.nn.Parameter]:
    """id(original param) -> DTensor shard, plus the shards themselves (already-remapped optimizers).

    The original ids are only meaningful while the originals are alive: ``fully_shard`` checked
    before wrapping that every optimizer param is a module param, and the optimizer keeps those
    alive, so no id in its groups can have been reused by another object."""
    mapping: dict[int, torch.nn.Parameter] = {}
    engine: FSDPEngine = model._fsdp_engine  # type: ignore[assignment]
    for unit in engine.units:
        for p in unit.params:
            mapping[p.orig_id] = p.sharded
            mapping[id(p.sharded)] = p.sharded
    return mapping


def remap_optimizer_params(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.nn.Parameter]) -> None:
    """Replace each original param in the optimizer's groups by its DTensor shard, in place."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError("optimizer already has state (it has stepped); build it on the unwrapped "
                         "module's params before any step, or on model.parameters() after wrapping")
    new_groups: list[list[torch.nn.Parameter]] = []
    for gi, group in enumerate(optimizer.param_groups):
        params = []
        for p in group["params"]:
            if id(p) not in mapping:
                raise ValueError(f"optimizer param group {gi} holds a parameter of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the wrapped module; "
                                 "the optimizer's params must be the model's")
            params.append(mapping[id(p)])
        new_groups.append(params)
    for group, params in zip(optimizer.param_groups, new_groups, strict=True):
        group["params"] = params
    optimizer.state.clear()


@contextlib.contextmanager
def hide_buffer_grads(engines: list[FSDPEngine], params: Iterable[torch.Tensor], active: bool) -> Iterator[None]:
    """While active, ``.grad`` is None on every param whose grad is a view of an engine grad
    buffer; restored afterwards. ``zero_grad(set_to_none=False)`` resets those buffers whole
    (one fill each, after everything else), so the optimizer's / module's own zeroing of the
    views would only write the same zeros a second time (a full pass over the grads)."""
    hidden: list[tuple[torch.Tensor, torch.Tensor]] = []
    if active:
        ptrs = set().union(*(e.grad_buffer_ptrs() for e in engines))
        for p in params:
            g = p.grad
            if g is not None and local_tensor(g).untyped_storage().data_ptr() in ptrs:
                hidden.append((p, g))
                p.grad = None
    try:
        yield
    finally:
        for p, g in hidden:
            p.grad = g


def zero_grads_and_buffers(engines: list[FSDPEngine], params: list[torch.Tensor], set_to_none: bool,
                           own_zero_grad: Callable[..., None]) -> None:
    """The ``zero_grad`` of a bound optimizer and of a wrapped model: refuse what graph mode
    cannot take (before anything is reset), the caller's own reset (``own_zero_grad``, with the
    buffer views hidden), decoupled grads, then the engines' buffers last: their zeroing is then
    the latest write, so the next backward may overwrite them instead of adding
    (``DataParallelBuffer.take_zeroed`` checks exactly that)."""
    for engine in engines:
        engine.check_zero_grad(free=set_to_none)
    with hide_buffer_grads(engines, params, active=not set_to_none):
        own_zero_grad(set_to_none=set_to_none)
    clear_grads(params, any(e.config.use_decoupled_grad for e in engines), set_to_none)
    for engine in engines:
        engine.zero_grad_buffers(free=set_to_none)


def _traceable(engines: list[FSDPEngine]) -> bool:
    """Whether the bound models are in traceable mode (``fsdp_impl.traceable``; all or none)."""
    on = [e.traceable is not None for e in engines]
    if any(on) and not all(on):
        raise RuntimeError("an optimizer bound to several models needs all of them in traceable mode or none")
    return bool(on) and on[0]


class _FSDPOptimizerMixin(torch.optim.Optimizer):
    """Adds the FSDP buffer reset to ``zero_grad``. Only ever a base next to the user's optimizer
    class (``_FSDPOptimizerMixin, cls``), so ``super()`` is that class's ``zero_grad``."""

    _fsdp_engines: list[FSDPEngine]
    # set for an elementwise optimizer class (``local_step.ELEMENTWISE``); None: step on DTensors
    _fsdp_local_step: LocalShardStep | None

    def zero_grad(self, set_to_none: bool = True) -> None:
        if _traceable(self._fsdp_engines):  # grads are the params' own tensors, no buffer views
            traceable_zero_grad([p for g in self.param_groups for p in g["params"]], set_to_none)
            return
        zero_grads_and_buffers(self._fsdp_engines, [p for g in self.param_groups for p in g["params"]],
                               set_to_none, super().zero_grad)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The user's step, then the engines learn that their weights changed (a fused kernel
        updates them without bumping the version counters the engine reads)."""
        if _traceable(self._fsdp_engines):  # DTensor step (Dynamo traces it); set_traceable(False)
            return super().step(*args, **kwargs)  # marks the compute params stale instead of a bump
        local = self._fsdp_local_step
        # a closure re-runs the backward inside the step, after the grads were aliased; graph
        # mode replays the step without Python, so there is no host time to save
        if (local is None or args or "closure" in kwargs
                or any(engine.config.cuda_graph_mode for engine in self._fsdp_engines)):
            result = super().step(*args, **kwargs)
        else:
            result = local.run(self, super().step, **kwargs)
        for engine in self._fsdp_engines:
            engine.note_optimizer_step()
        return result


class _FSDPOffloadOptimizerMixin(_FSDPOptimizerMixin):
    """For models with ``offload_policy``: ``step`` runs on the host after a device sync
    (``step="cpu"``) or streams the host state through the device (``step="gpu"``)."""

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return offloaded_step(self, self._fsdp_engines, super().step, *args, **kwargs)


def attach_engines(optimizer: torch.optim.Optimizer, engines: list[FSDPEngine]) -> torch.optim.Optimizer:
    """Give ``optimizer`` the FSDP ``zero_grad`` (idempotent; several models may share one).
    A CUDA-graph-mode model's optimizer must be capturable, an offloaded model's optimizer one its
    ``offload_policy.step`` can run (checked before anything changes)."""
    if any(engine.config.cuda_graph_mode for engine in engines):
        check_optimizer_capturable(optimizer)
    bound = list(optimizer._fsdp_engines) if isinstance(optimizer, _FSDPOptimizerMixin) else []
    policy = offload_policy_of(bound + [e for e in engines if all(e is not b for b in bound)])
    check_offload_optimizer(policy, optimizer)
    if isinstance(optimizer, _FSDPOptimizerMixin):
        if policy is not None and not isinstance(optimizer, _FSDPOffloadOptimizerMixin):
            raise ValueError("this optimizer was bound to models without offload_policy; an offloaded model "
                             "needs its own optimizer")
        for engine in engines:
            if all(engine is not e for e in optimizer._fsdp_engines):
                optimizer._fsdp_engines.append(engine)
        if policy is not None:
            attach_overlap(optimizer, engines, policy)
        return optimizer
    cls = type(optimizer)
    mixin = _FSDPOptimizerMixin if policy is None else _FSDPOffloadOptimizerMixin
    optimizer.__class__ = type(f"FSDP{cls.__name__}", (mixin, cls),
                               {"__module__": cls.__module__, USER_CLASS_ATTR: cls})
    assert isinstance(optimizer, _FSDPOptimizerMixin)
    optimizer._fsdp_engines = list(engines)
    optimizer._fsdp_local_step = LocalShardStep() if policy is None and eligible_class(cls) else None
    if policy is not None:
        prepare_host_step(optimizer, policy)
        attach_overlap(optimizer, engines, policy)
    return optimizer


def bound_engines(optimizer: torch.optim.Optimizer) -> list[FSDPEngine]:
    """The engines whose buffers ``optimizer.zero_grad`` resets (empty if it is not bound)."""
    return list(optimizer._fsdp_engines) if isinstance(optimizer, _FSDPOptimizerMixin) else []
