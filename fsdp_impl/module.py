"""The wrapper ``nn.Module`` returned by ``fully_shard`` / ``fully_shard_model``."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .buffers import ParamAndGradBuffer
from .engine import FSDPEngine
from .mesh import DistIndex
from .offload.overlap import wait_for_model_step
from .optimizer_binding import zero_grads_and_buffers
from .policy import MixedPrecisionPolicy
from .traceable import set_traceable, traceable_forward


def _wait_before_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    wait_for_model_step(module._fsdp_engine)  # type: ignore[arg-type]


def _wait_before_load(module: nn.Module, *args: Any) -> None:
    wait_for_model_step(module._fsdp_engine)  # type: ignore[arg-type]


class FullyShardedModule(nn.Module):
    """Holds the user's module as ``self.module`` (its params are DTensor shards outside forward)
    and drives the root unit around each forward."""

    def __init__(self, module: nn.Module, engine: FSDPEngine, buffer: ParamAndGradBuffer,
                 dist_index: DistIndex, hook_handles: list[Any]) -> None:
        super().__init__()
        self.module = module
        self._fsdp_engine = engine
        self.param_and_grad_buffer = buffer
        self.dist_index = dist_index
        self._fsdp_hook_handles = hook_handles
        # OffloadPolicy(overlap_step="forward"): saving or loading waits for a host step running on
        self.register_state_dict_pre_hook(_wait_before_state_dict)
        self.register_load_state_dict_pre_hook(_wait_before_load)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        traceable = self._fsdp_engine.traceable
        if traceable is not None:  # fsdp_impl.traceable: functional gathers, no hooks
            return traceable_forward(self, traceable, args, kwargs)
        self._root_pre_forward()
        output = self.module(*args, **kwargs)
        self._root_post_forward(output)
        return output

    @torch.compiler.disable
    def _root_pre_forward(self) -> None:
        self._fsdp_engine.pre_forward(self._fsdp_engine.root)

    @torch.compiler.disable
    def _root_post_forward(self, output: Any) -> None:
        self._fsdp_engine.post_forward(self._fsdp_engine.root, output)

    def set_traceable(self, on: bool) -> None:
        """Traceable mode on or off (``fsdp_impl.traceable``): the forward becomes plain tensor code
        with functional collectives that ``torch.compile(fullgraph=True)`` can trace together with
        ``loss.backward()`` and ``optimizer.step()``; off (the default) is the eager engine."""
        if not isinstance(on, bool):
            raise TypeError(f"set_traceable(on) needs a bool, got {on!r}")
        set_traceable(self, on)

    def set_model_auto_sync(self, sync: bool) -> None:
        """False: following backwards only accumulate (no ``.grad`` on the optimizer params);
        True: the next backward synchronises and installs the grads."""
        if not isinstance(sync, bool):
            raise TypeError(f"set_model_auto_sync(sync) needs a bool, got {sync!r}")
        self._fsdp_engine.sync = sync

    @contextlib.contextmanager
    def mixed_precision_context(self, policy: MixedPrecisionPolicy) -> Iterator[None]:
        """Use ``policy.grad_comm_dtype`` for grad communication within the scope (the buffer
        dtypes are fixed at wrap time; ``None`` restores each unit's default)."""
        if not isinstance(policy, MixedPrecisionPolicy):
            raise TypeError(f"mixed_precision_context(policy) needs a MixedPrecisionPolicy, got {policy!r}")
        previous = self._fsdp_engine.comm_dtype_override
        self._fsdp_engine.comm_dtype_override = policy.grad_comm_dtype
        try:
            yield
        finally:
            self._fsdp_engine.comm_dtype_override = previous

    def zero_grad_buffer(self) -> None:
        """Zero the main-grad and accumulation buffers (the installed grads are views of them)."""
        self._fsdp_engine.zero_grad_buffers()

    def zero_grad(self, set_to_none: bool = True) -> None:
        zero_grads_and_buffers([self._fsdp_engine], list(self.parameters()), set_to_none, super().zero_grad)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None:
                raise
            return getattr(inner, name)

