"""The decoupled-gradient model, data, trainers and loss check shared by
``test_decoupled_grad.py`` (1-D meshes) and ``test_decoupled_grad_outer.py`` (HSDP/HFSDP).

Every numeric check is against a single-process reference: the same model, unwrapped, trained on
the concatenation of all ranks' micro-batches with ``torch.optim.AdamW`` and
``torch.nn.utils.clip_grad_norm_``. Each loss is a mean over samples, so the FSDP gradient (the
average of per-rank gradients) equals the reference's full-batch gradient up to summation order.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_impl import fully_shard
from fsdp_impl.clip_grad import clip_grad_norm
from fsdp_impl.optim import AdamW

from .numerics import loss_errors

STEPS = 5
LR = 1e-2
MAX_NORM = 0.05  # below the gradient norms seen here, so clipping really scales every step
SAMPLES_PER_RANK = 4
# fp32 throughout; FSDP sums gradients in a different order than the reference, so results agree
# to fp32 rounding. Measured on CPU/gloo: norms and losses within 1.1e-7 relative; the
# tolerances leave room for other reduction orders (NCCL) while a no-op or wrong step (losses off
# by > 1e-2) still fails by orders of magnitude.
# The world sizes the decoupled-grad suites run on (one bucket each).
WORLDS = [
    pytest.param(2, marks=pytest.mark.distributed(world_size=2), id="ws2"),
    pytest.param(4, marks=pytest.mark.distributed(world_size=4), id="ws4"),
]
NORM_RTOL = 1e-5
LOSS_RTOL = 1e-4


class DecoupledNet(nn.Module):
    """Two hidden Linear layers and a 1-output head.

    The head's weight (1, 16) and bias (1,) are smaller than the world, so with torch.chunk
    sharding the trailing ranks hold empty shards of them.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def global_batch(step: int, world: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The same batch every step: a healthy run's loss must then go down step after step."""
    del step  # kept in the signature so a per-step data schedule is a one-line change
    gen = torch.Generator().manual_seed(1234)
    n = SAMPLES_PER_RANK * world
    x = torch.randn(n, 6, generator=gen)
    y = torch.randn(n, 1, generator=gen)
    return x.to(device), y.to(device)


def local_batch(step: int, env: Any) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, env.world_size, env.device)
    rows = slice(env.rank * SAMPLES_PER_RANK, (env.rank + 1) * SAMPLES_PER_RANK)
    return x[rows], y[rows]


def build(env: Any) -> tuple[nn.Module, nn.Module]:
    """(module to wrap, identical reference copy), same weights on every rank."""
    torch.manual_seed(0)
    module = DecoupledNet().to(env.device)
    return module, copy.deepcopy(module)


def wrap(env: Any, strategy: int, optimizer_kwargs: dict[str, Any] | None = None, **kwargs: Any
          ) -> tuple[nn.Module, Any, nn.Module]:
    module, ref = build(env)
    optimizer = AdamW(module.parameters(), lr=LR, use_decoupled_grad=True, **(optimizer_kwargs or {}))
    model, optimizer = fully_shard(
        module,
        optimizer,
        fsdp_unit_modules=[nn.Linear],
        zero_dp_strategy=strategy,
        use_decoupled_grad=True,
        **kwargs,
    )
    return model, optimizer, ref


def global_mean(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


@dataclass
class Trace:
    """What one training run produced, step by step."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)


def train_clipped(model: nn.Module, optimizer: Any, env: Any, steps: int = STEPS) -> Trace:
    trace = Trace()
    for step in range(steps):
        x, y = local_batch(step, env)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        trace.norms.append(clip_grad_norm(model, MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        model.zero_grad()  # also resets the FSDP buffers when the optimizer was not wrapped
        trace.losses.append(global_mean(loss))
    return trace


def train_clipped_reference(ref: nn.Module, env: Any, steps: int = STEPS) -> Trace:
    optimizer = torch.optim.AdamW(ref.parameters(), lr=LR)
    trace = Trace()
    for step in range(steps):
        x, y = global_batch(step, env.world_size, env.device)
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        trace.norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        optimizer.step()
        optimizer.zero_grad()
        trace.losses.append(loss.item())
    return trace


def loss_check_problem(losses: list[float], reference: list[float], rtol: float = LOSS_RTOL) -> str | None:
    """Why a run's losses fail "must decrease and match the reference", or None if they pass.

    This is the detector for the silent no-op step: a run whose optimizer never sees a
    gradient keeps its initial loss, so it neither decreases nor follows the reference.
    """
    if len(losses) != len(reference):
        return f"{len(losses)} losses for {len(reference)} reference losses"
    if not all(math.isfinite(v) for v in losses):
        return f"non-finite loss in {losses}"
    if not losses[-1] < losses[0]:
        return f"loss did not decrease: {losses}"
    deviations = loss_errors(losses, reference)
    worst = max(range(len(deviations)), key=deviations.__getitem__)
    if deviations[worst] > rtol:
        return (f"step {worst}: loss {losses[worst]!r} differs from the reference {reference[worst]!r} by "
                f"{deviations[worst]:.2e} relative (rtol {rtol}); losses {losses} vs {reference}")
    return None
