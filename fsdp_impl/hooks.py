"""Registration of the forward and grad hooks that call into ``FSDPEngine``.

Each hook is a small callable object naming the engine and its unit explicitly (PyTorch FSDP2
style); the handles are kept so ``remove_hooks`` can undo everything.

The hooks hold the engine by weak reference and the unit by its index: a strong reference would
close a cycle (module -> hook -> engine -> unit -> module, and compute param -> grad hook ->
engine -> unit -> compute param, whose hook dict is held from C++ where the garbage collector
cannot see it), so the engine and its buffers would outlive ``del model`` until a
``gc.collect()``, or forever. The wrapper (``FullyShardedModule``) holds the engine strongly.
"""
from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .engine import FSDPEngine, outside_forward_error
from .param import ManagedParam
from .unit import FSDPUnit


class _UnitHook:
    """What every hook holds: a weak reference to the engine and the index of its unit."""

    def __init__(self, engine: FSDPEngine, unit: FSDPUnit) -> None:
        self._engine = weakref.ref(engine)
        self._unit = engine.units.index(unit)

    def target(self) -> tuple[FSDPEngine, FSDPUnit]:
        engine = self._engine()
        if engine is None:
            raise RuntimeError("this module's fully_shard wrapper was garbage collected, which released its "
                               "FSDP engine and buffers; keep the wrapper returned by fully_shard / "
                               "fully_shard_model and call that instead of the inner module")
        return engine, engine.units[self._unit]


class _PreForward(_UnitHook):
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> None:
        engine, unit = self.target()
        engine.pre_forward(unit)


class _PostForward(_UnitHook):
    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        engine, unit = self.target()
        engine.post_forward(unit, output)


class _SubmodulePreForward(_UnitHook):
    """``enable_fine_grained_param_gather``: on each module holding a unit's params."""

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> None:
        engine, unit = self.target()
        engine.submodule_pre_forward(unit, module)


class _ShardedGuard(_UnitHook):
    """On a module holding a unit's params that no other engine hook covers: present only while
    the unit is swapped out (``FSDPUnit.swap_in`` removes it, ``swap_out`` puts it back), so a
    call of the module then gets our error instead of torch's ``mixed torch.Tensor and DTensor``,
    and the forward, which swaps in first, runs the module without this (or any) hook."""

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> None:
        engine, unit = self.target()
        raise outside_forward_error(unit, module)


class _GradReady(_UnitHook):
    """``register_post_accumulate_grad_hook`` target on one unsharded compute param."""

    def __init__(self, engine: FSDPEngine, unit: FSDPUnit, param: ManagedParam) -> None:
        super().__init__(engine, unit)
        self._param = param.grad_slot

    def __call__(self, tensor: torch.Tensor) -> None:
        engine, unit = self.target()
        engine.grad_ready(unit, unit.trainable[self._param])


def register_hooks(engine: FSDPEngine, unit_modules: list[nn.Module]) -> list[RemovableHandle]:
    """Forward pre/post hooks on each unit module (the root is driven by the wrapper's forward),
    a pre-forward hook on the submodules ``FSDPUnit.hooked_submodules`` names (after the unit's
    own), a guard on the other modules holding a unit's params (``_ShardedGuard``; the units are
    swapped out now, so every guard starts in place), and a post-accumulate-grad hook on every
    trainable compute param."""
    handles: list[RemovableHandle] = []
    units_at = {id(m) for m in unit_modules}  # a unit module's own call is its unit's forward
    for unit, module in zip(engine.units, unit_modules, strict=True):
        hooked = unit.hooked_submodules() if unit is not engine.root else []
        if unit is not engine.root:
            handles.append(module.register_forward_pre_hook(_PreForward(engine, unit)))
            handles.append(module.register_forward_hook(_PostForward(engine, unit)))
            handles += [m.register_forward_pre_hook(_SubmodulePreForward(engine, unit)) for m in hooked]
        for m in unit.param_modules():
            if id(m) not in units_at and all(m is not h for h in hooked):
                guard = _ShardedGuard(engine, unit)
                handle = m.register_forward_pre_hook(guard)
                unit.guards.append((m._forward_pre_hooks, handle.id, guard))
                handles.append(handle)
        for p in unit.trainable:
            handles.append(p.unsharded.register_post_accumulate_grad_hook(_GradReady(engine, unit, p)))
    return handles
