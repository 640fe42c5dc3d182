"""A tiny residual model that recomputes activations every way users do, and the run record the
activation-recompute suite compares bit for bit against the same model without recompute.

Styles (``STYLES``):

- ``none``: no recompute (the reference);
- ``inside`` / ``inside_reentrant``: each block's forward runs its MLP under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False/True)`` (Hugging Face gradient
  checkpointing inside a layer, Megatron-Core's partial recompute); the block's norm/projection
  stay outside the checkpoint, so a unit has params both inside and outside the region;
- ``selective``: the same region with ``create_selective_checkpoint_contexts`` (matmul outputs
  saved, everything else recomputed);
- ``wrapper`` / ``wrapper_reentrant``: ``apply_activation_checkpointing(check_fn=...)`` around every
  block (``checkpoint_wrapper``, non-reentrant / reentrant) before ``fully_shard``;
  ``wrapper_after``: the same applied to the wrapped model's blocks after ``fully_shard``;
- ``region``: one non-reentrant checkpoint around ``region`` (default 2) consecutive blocks (a
  region holding several units; nested units).

Dims give uneven shards and, at 4 ranks, empty ones: ``mlp.fc2`` has 5 rows (2, 2, 1, 0 per rank)
and ``mlp.fc1`` 7 (2, 2, 2, 1).
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import checkpoint

from .models import ResidualMLP

STYLES = ("none", "inside", "inside_reentrant", "selective", "wrapper", "wrapper_reentrant",
          "wrapper_after", "region")
INSIDE = ("inside", "inside_reentrant", "selective")  # styles that recompute inside the unit
WRAPPER_NAME = "_checkpoint_wrapped_module."
D, HIDDEN, D_IN, D_OUT = 5, 7, 3, 2


class RecomputeBlock(nn.Module):
    """``h = x + proj(norm0(x))`` then the ``ResidualMLP`` ``h + fc2(gelu(fc1(norm(h))))``, whose
    MLP recomputes as ``style`` says (the ``inside*``/``selective`` styles)."""

    def __init__(self, style: str = "none", dtype: torch.dtype = torch.float32, d: int = D,
                 hidden: int = HIDDEN) -> None:
        super().__init__()
        self.norm0 = nn.LayerNorm(d, dtype=dtype)
        self.proj = nn.Linear(d, d, bias=False, dtype=dtype)
        self.mlp = ResidualMLP(d, hidden, norm=True, dtype=dtype, recompute=style if style in INSIDE else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x + self.proj(self.norm0(x)))


class RecomputeNet(nn.Module):
    """Root params (``inp``, ``out``) around ``layers`` units (``RecomputeBlock``); style
    ``region`` checkpoints ``region`` consecutive blocks at a time."""

    def __init__(self, style: str = "none", layers: int = 4, dtype: torch.dtype = torch.float32,
                 region: int = 2, d: int = D, hidden: int = HIDDEN) -> None:
        super().__init__()
        if style not in STYLES:
            raise ValueError(f"style {style!r}; allowed: {STYLES}")
        self.style, self.region = style, region
        self.inp = nn.Linear(D_IN, d, dtype=dtype)
        self.blocks = nn.ModuleList([RecomputeBlock(style, dtype, d, hidden) for _ in range(layers)])
        self.out = nn.Linear(d, D_OUT, dtype=dtype)

    def _run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks[i:i + self.region]:
            x = block(x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        if self.style == "region":
            for i in range(0, len(self.blocks), self.region):
                x = checkpoint(self._run, i, x, use_reentrant=False)
        else:
            for block in self.blocks:
                x = block(x)
        return self.out(x)


def wrap_blocks(module: nn.Module, reentrant: bool = False) -> None:
    """``apply_activation_checkpointing`` around every ``RecomputeBlock`` of ``module``."""
    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(module, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                                                   checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, RecomputeBlock))


def build_net(style: str, seed: int = 0, device: str | None = None, layers: int = 4,
              dtype: torch.dtype = torch.float32, region: int = 2, d: int = D, hidden: int = HIDDEN) -> nn.Module:
    """The model for ``style`` (seeded; the wrapper styles applied before wrapping already)."""
    torch.manual_seed(seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        net = RecomputeNet(style, layers, dtype, region, d, hidden)
    if style in ("wrapper", "wrapper_reentrant"):
        wrap_blocks(net, reentrant=style == "wrapper_reentrant")
    return net


def batch(step: int, n: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step``: ``n`` sequences of 4 tokens and their regression targets."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, 4, D_IN, generator=gen).to(dtype), torch.randn(n, 4, D_OUT, generator=gen)


def clean_name(name: str) -> str:
    """A param name without ``checkpoint_wrapper``'s prefix, so styles compare name by name."""
    return name.replace(WRAPPER_NAME, "")


@dataclass
class RunRecord:
    """What a run produced, compared bit for bit between recompute styles."""

    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)  # synced grads per step
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # trained full params


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every synced grad (``.grad`` or ``.decoupled_grad``) as a full tensor (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.module.named_parameters():
        g = p.grad if p.grad is not None else getattr(p, "decoupled_grad", None)
        assert g is not None, f"{name}: no grad after the sync backward"
        out[clean_name(name)] = g.full_tensor().detach().float().cpu().clone()  # no_shard: a view of the buffer
    return out


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, local_batch: int, device: torch.device,
          dtype: torch.dtype = torch.float32) -> RunRecord:
    """``steps`` steps on this rank's slice of the global batches; record losses, grads, params."""
    rank, world = dist.get_rank(), dist.get_world_size()
    record = RunRecord()
    for step in range(steps):
        x, y = batch(step, world * local_batch, dtype)
        x = x[rank * local_batch:(rank + 1) * local_batch].to(device)
        y = y[rank * local_batch:(rank + 1) * local_batch].to(device)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        record.losses.append(total.item())
        record.grads.append(full_grads(model))
        opt.step()
        opt.zero_grad()
    record.params = {clean_name(n): p.full_tensor().detach().float().cpu().clone()
                     for n, p in model.module.named_parameters()}
    return record


def assert_bit_identical(got: RunRecord, want: RunRecord, what: str) -> None:
    """Recompute does not change the math: losses, every step's grads and the trained params must
    be equal bit for bit (the same kernels on the same values, only run again)."""
    assert got.losses == want.losses, f"{what}: losses {got.losses} != {want.losses}"
    for step, (g, w) in enumerate(zip(got.grads, want.grads, strict=True)):
        assert g.keys() == w.keys(), f"{what}: step {step} grads for {sorted(g)} vs {sorted(w)}"
        bad = [n for n in w if not torch.equal(g[n], w[n])]
        assert not bad, f"{what}: step {step} grads differ for {bad}"
        zero = [n for n in w if not w[n].any()]
        assert not zero, f"{what}: step {step} reference grads are all zero for {zero} (test cannot fail)"
    bad = [n for n in want.params if not torch.equal(got.params[n], want.params[n])]
    assert not bad, f"{what}: trained params differ for {bad}"
