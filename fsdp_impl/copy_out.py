"""Copying gathered flat values into a unit's compute params, with the targets kept between steps.

Every unshard copies the gathered (or, ZeRO-1/2, the refreshed) flat segment into the compute
tensors of the unit's params. The tensors, the per-slot views the fused copy writes through and
the version counters the copy must not bump are the same every step, so they are built once:
rebuilding them was per-param host work on every unshard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .buffers import DataParallelBuffer
from .param import ManagedParam
from .sharding import FlatLayout, UnpackPlan


def versioned(params: list[ManagedParam]) -> tuple[torch.Tensor, ...]:
    """Writes into the compute storage must not bump the version counters autograd checks (each
    compute param's and, for a TP DTensor, its local tensor's): every one of them, for one
    ``_unsafe_preserve_version_counter`` around the copy."""
    tensors: list[torch.Tensor] = []
    for p in params:
        tensors.append(p.unsharded)
        if p.compute_local() is not p.unsharded:
            tensors.append(p.compute_local())
    return tuple(tensors)


@dataclass
class _Targets:
    """What a copy into ``params``' compute tensors needs (fixed once the params are sharded)."""

    params: list[ManagedParam]
    layout: FlatLayout
    versioned: tuple[torch.Tensor, ...]  # whose version counters the copy must not bump
    tensors: list[torch.Tensor]  # the compute tensors, in ``layout`` slot order
    plan: UnpackPlan


class ComputeCopy:
    """One unit's copy-out into its compute params."""

    def __init__(self) -> None:
        self._targets: _Targets | None = None
        # ``from_shards``: (weight buffer, params, their versioned tensors, (dsts, srcs) per dtype pair)
        self._direct: tuple[torch.Tensor, list[ManagedParam], tuple[torch.Tensor, ...],
                            list[tuple[list[torch.Tensor], list[torch.Tensor]]]] | None = None

    def __call__(self, gathered: torch.Tensor, layout: FlatLayout, params: list[ManagedParam], fused: bool) -> None:
        """Copy ``params`` out of ``gathered`` (laid out by ``layout``) into their compute tensors
        (``fused``: one ``split_with_sizes_copy``; CUDA-graph mode copies param by param)."""
        t = self._targets_for(params, layout)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t.versioned):
            layout.unpack_all(gathered, t.tensors, fused=fused, plan=t.plan)

    def from_shards(self, weight: DataParallelBuffer, indices: list[int], params: list[ManagedParam]) -> None:
        """One rank: copy ``params`` (at ``indices`` of ``weight``, the unit's weight buffer)
        straight from their main shards, each the param's full local value, cast to the compute
        dtype: one multi-tensor copy per dtype pair, nothing staged (an FP8 unit's other params,
        whose FP8 bytes need no gather either). The pairs are built once per weight tensor."""
        t = self._direct
        if t is None or t[0] is not weight.data or t[1] is not params:
            tensors = [p.compute_local() for p in params]
            sources = [weight.local_view(i) for i in indices]
            groups: dict[tuple[torch.dtype, torch.dtype], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            for dst, src in zip(tensors, sources, strict=True):
                if dst.numel():
                    pair = groups.setdefault((dst.dtype, src.dtype), ([], []))
                    pair[0].append(dst.view(-1))
                    pair[1].append(src.reshape(-1))
            t = self._direct = (weight.data, params, versioned(params), list(groups.values()))
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t[2]):
            for dsts, srcs in t[3]:
                torch._foreach_copy_(dsts, srcs)

    def forget(self) -> None:
        """The compute tensors moved to other storage (the unshard pool): rebuild the views."""
        self._targets = None
        self._direct = None

    def _targets_for(self, params: list[ManagedParam], layout: FlatLayout) -> _Targets:
        """Built on first use and kept: ``params`` is always the same list object (all params, or
        an FP8 unit's others); only the pool moves compute tensors, and it calls ``forget``."""
        t = self._targets
        if t is None or t.params is not params or t.layout is not layout:
            tensors = [p.compute_local() for p in params]
            t = self._targets = _Targets(params, layout, versioned(params), tensors, layout.unpack_plan(tensors))
        return t
