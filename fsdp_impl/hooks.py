"""Registration of the forward and grad hooks that call into ``FSDPEngine``.

Each hook is a small callable object holding the engine and its unit explicitly (PyTorch FSDP2
style); the handles are kept so ``remove_hooks`` can undo everything.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from .engine import FSDPEngine
from .param import ManagedParam
from .unit import FSDPUnit


class _PreForward:
    def __init__(self, engine: FSDPEngine, unit: FSDPUnit) -> None:
        self.engine, self.unit = engine, unit

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any) -> None:
        self.engine.pre_forward(self.unit)


class _PostForward:
    def __init__(self, engine: FSDPEngine, unit: FSDPUnit) -> None:
        self.engine, self.unit = engine, unit

    @torch.compiler.disable
    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        self.engine.post_forward(self.unit, output)


class _GradReady:
    """``register_post_accumulate_grad_hook`` target on one unsharded compute param."""

    def __init__(self, engine: FSDPEngine, unit: FSDPUnit, param: ManagedParam) -> None:
        self.engine, self.unit, self.param = engine, unit, param

    def __call__(self, tensor: torch.Tensor) -> None:
        self.engine.grad_ready(self.unit, self.param)


def register_hooks(engine: FSDPEngine, unit_modules: list[nn.Module]) -> list[RemovableHandle]:
    """Forward pre/post hooks on each unit module (the root is driven by the wrapper's forward)
    and a post-accumulate-grad hook on every trainable compute param."""
    handles: list[RemovableHandle] = []
    for unit, module in zip(engine.units, unit_modules, strict=True):
        if unit is not engine.root:
            handles.append(module.register_forward_pre_hook(_PreForward(engine, unit)))
            handles.append(module.register_forward_hook(_PostForward(engine, unit)))
        for p in unit.trainable:
            handles.append(p.unsharded.register_post_accumulate_grad_hook(_GradReady(engine, unit, p)))
    return handles
