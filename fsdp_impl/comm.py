"""Thin wrappers over the collectives the engine issues, so every call site names the group,
the same ops run on gloo (CPU) and NCCL (GPU), and every collective shows up in profiler traces
under an ``FSDP::`` label."""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist
from torch.profiler import record_function


def profiling() -> bool:
    """Whether a profiler records now: only then are ``FSDP::`` labels entered, because entering
    a ``record_function`` is a dispatcher call even when nobody listens (tens of microseconds of
    host time per use on a busy GPU host, and the engine enters several per unit per step)."""
    return bool(torch._C._autograd._profiler_enabled())


def traced(label: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(label)`` while a profiler records (``profiling``), else nothing."""
    return record_function(label) if profiling() else contextlib.nullcontext()


def solo(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` (``None``: the default group) has one rank. Its collectives then move
    nothing: a gather or reduce-scatter is a copy of the input and an all-reduce leaves the
    tensor as it is (SUM, AVG, MAX over one value is that value, bit for bit), so they run as
    local copies without the process group's launch and bookkeeping. Only this rank is in the
    group, so no other rank's collective order can be affected."""
    return (group.size() if group is not None else dist.get_world_size()) == 1


def _copy_as_collective(output: torch.Tensor, local: torch.Tensor) -> None:
    """A one-rank gather / reduce-scatter: ``output`` gets ``local`` (same checks the process
    group makes: equal dtype and size, so a bug cannot hide behind a silent cast)."""
    if output.dtype != local.dtype or output.numel() != local.numel():
        raise ValueError(f"collective on one rank: output {output.dtype}[{output.numel()}] does not match "
                         f"input {local.dtype}[{local.numel()}]")
    if output.data_ptr() != local.data_ptr():  # an in-place gather has nothing to move
        output.view(-1).copy_(local.view(-1))


def all_gather(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Gather equal-sized ``local`` segments of every rank into ``output`` (rank-major)."""
    if solo(group):
        _copy_as_collective(output, local)
        return
    with traced("FSDP::all_gather"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames it; 2.11 has only this name
        dist.all_gather_into_tensor(output, local, group=group)


def all_reduce_max(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """MAX over ``group`` (``None``: the default group, i.e. every rank)."""
    if solo(group):
        return
    with traced("FSDP::all_reduce"):
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)


# --- Reductions with a chosen op (fully_shard's average_in_collective / calculate_per_token_loss
# pick SUM or AVG); same labels as the AVG forms above.
def reduce_scatter_op(output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup,
                      op: dist.ReduceOp.RedOpType) -> None:
    """Reduce ``full`` over ranks with ``op`` and keep this rank's segment in ``output``."""
    if solo(group):
        _copy_as_collective(output, full)
        return
    with traced("FSDP::reduce_scatter"), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        dist.reduce_scatter_tensor(output, full, op=op, group=group)


def all_reduce_op(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType) -> None:
    if solo(group):
        return
    with traced("FSDP::all_reduce"):
        dist.all_reduce(tensor, op=op, group=group)
