"""How a unit's synced grad shards appear on its DTensor params (``.grad`` or ``.decoupled_grad``).

Same dtype: a persistent DTensor view of the grad buffer, made once (``DTensor`` creation is slow)
and re-installed after ``zero_grad(set_to_none=True)``: freeing the buffer keeps its storage
object, so the views see the re-allocated memory. Different dtype (e.g. fp32 grads for bf16 main
params): a cast copy, because torch requires ``grad.dtype == param.dtype``; under CUDA-graph mode
the copy is persistent too (re-filled in place).
"""
from __future__ import annotations

import torch

from .buffers import DataParallelBuffer
from .decoupled import grad_attr_name
from .param import ManagedParam
from .placement import PlacementPlan, local_tensor


class GradViews:
    """The grads installed on one unit's trainable params, cached where they can be reused."""

    def __init__(self, trainable: list[ManagedParam], plan: PlacementPlan, graph_mode: bool) -> None:
        self.trainable = trainable
        self.plan = plan
        self.graph_mode = graph_mode
        self._cache: list[torch.Tensor | None] = [None] * len(trainable)

    def install(self, buffer: DataParallelBuffer, decoupled: bool) -> None:
        """Set each trainable param's grad attribute from ``buffer`` (device or host grads)."""
        attr = grad_attr_name(decoupled)
        for p in self.trainable:
            i, sharded = p.grad_slot, p.sharded
            cached = self._cache[i]
            if cached is not None:
                if local_tensor(cached).dtype != buffer.dtype:
                    local_tensor(cached).copy_(buffer.local_view(i))
                if getattr(sharded, attr, None) is not cached:
                    setattr(sharded, attr, cached)
                continue
            local = buffer.local_view(i)
            is_view = decoupled or local.dtype == sharded.dtype
            g = self.plan.wrap(local if is_view else local.to(sharded.dtype), p.tp, p.shape)
            if is_view or self.graph_mode:
                self._cache[i] = g
            setattr(sharded, attr, g)
