"""Model-level FP8 state a data-parallel engine drives: which modules hold FP8 weights, and the
once-per-step reduction of the delayed-scaling amaxes.

Under data parallelism every rank casts different activations, so each delayed-scaling
quantizer is put in ``deferred`` mode (casts only record their amax); once per optimisation
step the engine calls ``pack_pending`` on every rank, MAX-reduces the packed buffer over the
data-parallel group (one collective) and hands the result to ``advance_all``. All ranks then hold
the same histories and scales as a single process that saw the whole batch (the max over ranks
is the max over the batch), so checkpoints of them are rank-independent.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .linear import Float8Linear
from .quantizer import DelayedQuantizer


def fp8_linears(model: nn.Module) -> list[Float8Linear]:
    """The model's ``Float8Linear`` modules in ``named_modules`` order (same on every rank)."""
    return [m for m in model.modules() if isinstance(m, Float8Linear)]


def delayed_quantizers(model: nn.Module) -> list[DelayedQuantizer]:
    """Every delayed-scaling quantizer of the model, in module then role order."""
    return [q for m in fp8_linears(model) for q in m.fp8_quantizers.all() if isinstance(q, DelayedQuantizer)]


def set_deferred(quantizers: list[DelayedQuantizer], deferred: bool = True) -> None:
    for q in quantizers:
        q.deferred = deferred


def pack_pending(quantizers: list[DelayedQuantizer]) -> torch.Tensor:
    """This rank's pending amaxes, one fp32 value per quantizer, in list order."""
    if not quantizers:
        return torch.zeros(0)
    return torch.stack([q.pending.reshape(()) for q in quantizers]).float()


@torch.no_grad()
def advance_all(quantizers: list[DelayedQuantizer], reduced: torch.Tensor) -> None:
    """Store the reduced amaxes as pending, then advance every history."""
    if reduced.numel() != len(quantizers):
        raise ValueError(f"{reduced.numel()} reduced amaxes for {len(quantizers)} delayed-scaling quantizers")
    for q, amax in zip(quantizers, reduced.unbind(0), strict=True):
        q.pending.copy_(amax)
        q.advance()
