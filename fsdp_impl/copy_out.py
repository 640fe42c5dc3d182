"""Copying gathered flat values into a unit's compute params, with the targets kept between steps.

Every unshard copies the gathered (or, ZeRO-1/2, the refreshed) flat segment into the compute
tensors of the unit's params. The tensors, the per-slot views the fused copy writes through and
the version counters the copy must not bump are the same every step, so they are built once:
rebuilding them was per-param host work on every unshard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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

    def __call__(self, gathered: torch.Tensor, layout: FlatLayout, params: list[ManagedParam], fused: bool) -> None:
        """Copy ``params`` out of ``gathered`` (laid out by ``layout``) into their compute tensors
        (``fused``: one ``split_with_sizes_copy``; CUDA-graph mode copies param by param)."""
        t = self._targets_for(params, layout)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(t.versioned):
            layout.unpack_all(gathered, t.tensors, fused=fused, plan=t.plan)

    def forget(self) -> None:
        """The compute tensors moved to other storage (the unshard pool): rebuild the views."""
        self._targets = None

    def _targets_for(self, params: list[ManagedParam], layout: FlatLayout) -> _Targets:
        """Built on first use and kept: ``params`` is always the same list object (all params, or
        an FP8 unit's others); only the pool moves compute tensors, and it calls ``forget``."""
        t = self._targets
        if t is None or t.params is not params or t.layout is not layout:
            tensors = [p.compute_local() for p in params]
            t = self._targets = _Targets(params, layout, versioned(params), tensors, layout.unpack_plan(tensors))
        return t
