"""Traceable mode: a forward of a wrapped model that ``torch.compile(fullgraph=True)`` can trace
whole, together with ``loss.backward()`` and ``optimizer.step()`` (issue 50, item 3).

Why a mode of its own: the eager engine drives each unit from module and grad hooks that keep
Python state, side streams and c10d calls, and it is ``torch.compiler.disable``d on purpose, so
Dynamo breaks the graph at every unit. In traceable mode the wrapper's forward is instead plain
tensor code that Dynamo can follow:

* per unit, one all-gather of its flat weight segment as a functional collective
  (``_c10d_functional.all_gather_into_tensor`` + ``wait_tensor``), inside an autograd function
  whose backward is the unit's grad reduction: cast to the grad-comm dtype, the engine's
  pre-scale, one functional ``reduce_scatter_tensor`` with the engine's op (the same arithmetic
  as ``grad_reduce.ShardGroupReduce``, so the grads are bitwise the engine's);
* the segment is built from the DTensor params' local shards (``to_local``), so autograd, and
  Dynamo's traced ``Tensor.backward()`` (``torch._dynamo.config.trace_autograd_ops``), deliver
  each grad as a DTensor ``.grad`` of the very params the optimizer holds;
* the module runs under ``torch.func.functional_call`` with the gathered params; the engine's
  hooks are removed for the mode (they would run their eager state machine);
* the bound optimizer steps the DTensor params as they are (no local-shard swap, no engine
  version bump) and its ``zero_grad`` drops or zeroes the ``.grad`` tensors (``traceable_zero_grad``).

The same code runs eagerly, which is how the tests compare it with the engine step for step.
What it does not do (documented in fsdp_impl/README.md, "Whole-step compile: status"): free a
ZeRO-3 unit's gathered params between its forward and backward (they live through the step, as
under ZeRO-2; which buffers a compiled graph keeps is the compiler's choice), nor any of the
configurations ``check_traceable`` refuses.

The eager engine is untouched while the mode is off: the only gates are one attribute read in
the wrapper's forward and in the bound optimizer's ``step`` / ``zero_grad``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.func import functional_call

from .hooks import register_hooks
from .sharding import FlatLayout

if TYPE_CHECKING:
    from .engine import FSDPEngine
    from .module import FullyShardedModule
    from .unit import FSDPUnit

_ops = torch.ops._c10d_functional


class TraceableState:
    """What traceable mode needs per model, built once when the mode is entered."""

    def __init__(self, engine: FSDPEngine) -> None:
        self.units = [_UnitPlan(u, engine) for u in engine.units if u.params]


class _UnitPlan:
    """One unit's gather and reduction, as constants Dynamo can bake into a graph."""

    def __init__(self, unit: FSDPUnit, engine: FSDPEngine) -> None:
        ctx = unit.ctx
        self.unit = unit
        self.layout: FlatLayout = unit.weight.layout
        self.params = unit.params
        self.fqns = [p.fqn for p in unit.params]
        self.group_name: str = ctx.group.group_name
        self.world = ctx.num_shards
        self.compute = unit.dtypes.compute
        scaling = ctx.grad_scaling
        self.pre_scale = scaling.pre_scale if scaling.pre_scale not in (None, 1.0) else None
        self.op = "avg" if scaling.average else "sum"
        # padded rows per param: the segment is this rank's rows of each param, zero-padded
        self.padded = [slot.padded_numel for slot in self.layout.slots]


class _GatherUnit(torch.autograd.Function):
    """Forward: all-gather a unit's flat segment in the compute dtype. Backward: the engine's grad
    reduction of the gathered tensor's grad (comm dtype, pre-scale, reduce-scatter, op)."""

    @staticmethod
    def forward(ctx: Any, segment: torch.Tensor, compute: torch.dtype, comm: torch.dtype,
                pre_scale: float | None, op: str, world: int, group_name: str) -> torch.Tensor:
        ctx.meta = (segment.dtype, comm, pre_scale, op, world, group_name)
        source = segment.to(compute)
        if world == 1:
            return source.clone() if source is segment else source
        return _ops.wait_tensor(_ops.all_gather_into_tensor(source, world, group_name))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        main, comm, pre_scale, op, world, group_name = ctx.meta
        full = grad.to(comm)
        if pre_scale is not None:
            full = full * pre_scale
        if world > 1:
            full = _ops.wait_tensor(_ops.reduce_scatter_tensor(full, op, world, group_name))
        return full.to(main), None, None, None, None, None, None


def _segment(plan: _UnitPlan) -> torch.Tensor:
    """This rank's flat segment of the unit, built from the DTensor params' local shards (so the
    grads reach those params): each shard's rows, zero-padded to the slot's width."""
    pieces = []
    for p, width in zip(plan.params, plan.padded, strict=True):
        local = cast(DTensor, p.sharded).to_local().reshape(-1)  # every managed param's shard is a DTensor
        if local.numel() < width:
            local = torch.nn.functional.pad(local, (0, width - local.numel()))
        pieces.append(local)
    return torch.cat(pieces)


def _split(full: torch.Tensor, plan: _UnitPlan) -> list[torch.Tensor]:
    """The full params out of a gathered unit ([world, segment], rank-major): each param's column
    block of every rank, its padding cut off (contiguous tensors, as the engine's copy-out)."""
    rows = full.view(plan.world, plan.layout.segment_numel)
    blocks = torch.split(rows, plan.layout.split_sizes, dim=1)
    out = []
    for p, block in zip(plan.params, blocks, strict=True):
        numel = 1
        for s in p.layout_shape:
            numel *= s
        out.append(block.reshape(-1)[:numel].view(p.layout_shape))
    return out


def traceable_forward(model: FullyShardedModule, state: TraceableState, args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> Any:
    """The wrapper's forward in traceable mode: gather every unit, run the module on the full
    params. Units are gathered in the engine's order (root last), identically on every rank."""
    engine = model._fsdp_engine
    params: dict[str, torch.Tensor] = {}
    for plan in state.units:
        comm = engine.comm_dtype(plan.unit)  # read per forward: mixed_precision_context may override it
        full = _GatherUnit.apply(_segment(plan), plan.compute, comm, plan.pre_scale, plan.op, plan.world,
                                 plan.group_name)
        for fqn, tensor in zip(plan.fqns, _split(full, plan), strict=True):
            params[fqn] = tensor
    return functional_call(model.module, params, args, kwargs, tie_weights=True, strict=False)


def traceable_zero_grad(params: list[torch.Tensor], set_to_none: bool) -> None:
    """``zero_grad`` of an optimizer bound to models in traceable mode. Not torch's
    ``Optimizer.zero_grad``: Dynamo skips that function (``torch._disable_dynamo``), so a step
    calling it could not be one graph. The grads here are plain ``.grad`` DTensors that autograd
    made (no graph of their own), so dropping or zeroing them is all there is to do."""
    for p in params:
        if p.grad is None:
            continue
        if set_to_none:
            p.grad = None
        else:
            p.grad.zero_()


def check_traceable(engine: FSDPEngine) -> None:
    """Refuse what traceable mode does not implement, naming the switch and what is allowed."""
    config = engine.config
    ctx = engine.ctx
    if not ctx.shards_grads:
        raise ValueError("traceable mode needs zero_dp_strategy 2 or 3 (optim_grads or optim_grads_params), "
                         f"got {config.strategy.name.lower()}")
    refused = {
        "outer_dp_sharding_strategy / HSDP": engine.outer_reducer is not None or ctx.two_level is not None,
        "fsdp_group_ag": ctx.gather_group is not None,
        "FP8 params": engine.fp8 is not None or any(u.fp8 is not None for u in engine.units),
        "offload_policy": engine.offload is not None,
        "cuda_graph_mode": config.cuda_graph_mode,
        "use_decoupled_grad": config.use_decoupled_grad,
        "nccl_ub": ctx.user_buffers is not None,
        "tensor-parallel params": any(p.tp is not None for u in engine.units for p in u.params),
        "expert-parallel units": any(u.ctx is not ctx for u in engine.units),
        "sync_model_each_microbatch=False / set_model_auto_sync(False)": not engine.sync,
    }
    for name, on in refused.items():
        if on:
            raise ValueError(f"traceable mode does not support {name}; turn it off (plain FSDP, ZeRO-2/3, "
                             "no FP8, offload, graph mode, decoupled grads or TP)")
    for unit in engine.units:
        if unit.dtypes.main_grads != unit.dtypes.main_params:
            raise ValueError(f"traceable mode needs main_grads_dtype == main_params_dtype (the grads land in the "
                             f"params' .grad), unit {unit.name!r} has {unit.dtypes.main_grads} and "
                             f"{unit.dtypes.main_params}")


def _unit_modules(model: FullyShardedModule) -> list[nn.Module]:
    """The unit modules in engine order (root last), as ``register_hooks`` takes them: a unit's
    name is its module's qualified name (``check_traceable`` refused expert units)."""
    engine = model._fsdp_engine
    return [model.module if unit is engine.root else model.module.get_submodule(unit.name)
            for unit in engine.units]


def set_traceable(model: FullyShardedModule, on: bool) -> None:
    """Enter (``on``) or leave traceable mode. Entering removes every engine hook and checks the
    configuration; leaving registers the hooks again and marks every unit's compute params stale,
    so the next eager forward rebuilds them from the (possibly updated) main weights. (The steps
    run in the mode write the params in place, which moves the version counters the ZeRO-1/2
    refresh reads anyway; the mark does not depend on how a backend writes them back.)"""
    engine = model._fsdp_engine
    if on == (engine.traceable is not None):
        return
    if on:
        check_traceable(engine)
        if getattr(model, "compile_stats", None) is not None:
            raise ValueError("traceable mode and compile_units are exclusive: compile the whole step instead")
        for handle in model._fsdp_hook_handles:
            handle.remove()
        model._fsdp_hook_handles = []
        for unit in engine.units:
            unit.guards.clear()
        engine.traceable = TraceableState(engine)
        return
    engine.traceable = None
    for unit in engine.units:
        unit.synced_version = -1
        unit.guards.clear()
    model._fsdp_hook_handles = register_hooks(engine, _unit_modules(model))
