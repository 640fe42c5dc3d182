"""Shared pieces of the FP8 suites: a small FP8 model, fixed data, the FSDP run and a
single-process reference that does the same arithmetic.

The reference is one process that emulates data parallelism instead of training on the global
batch at once: every step it runs each rank's microbatch slices separately (so current-scaling
activation and gradient scales come from the same tensors a rank sees), averages the slices'
bf16 grads in fp32 exactly as the reduce-scatter does (sum of the ranks, then divide), keeps fp32
master weights cast into the bf16 model before each step (what ``main_params_dtype=float32``
does), and defers delayed-scaling histories to one advance per step with the max over all
slices (what the engine's one MAX all-reduce gives). With the FP8 weights quantised from the same
bf16 values, the FSDP run can then match it to rounding noise instead of FP8 noise.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_impl
from fsdp_impl.fp8 import BlockwiseScaling, CurrentScaling, DelayedScaling, Recipe, convert_to_fp8
from fsdp_impl.fp8.state import advance_all, delayed_quantizers, pack_pending, set_deferred
from tests.functional.common.models import ResidualMLP
from tests.functional.common.training import train_accumulating

D, HIDDEN = 32, 48
SEQ, LOCAL_BATCH = 4, 2  # per rank and microbatch
RECIPES: dict[str, Callable[[], Recipe]] = {
    "current": CurrentScaling,
    "delayed": lambda: DelayedScaling(amax_history_len=4),
    # 16 (not 128) keeps the model tiny; 48-row weights over 2 ranks split a 16x16 block
    "blockwise": lambda: BlockwiseScaling(block_size=16),
}


class Fp8Block(ResidualMLP):
    """Pre-norm MLP block with a residual (an FSDP unit): LayerNorm and biases stay bf16.
    ``recompute=True`` runs the MLP under a non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, dtype: torch.dtype, recompute: bool = False) -> None:
        super().__init__(D, HIDDEN, norm=True, dtype=dtype, recompute="inside" if recompute else None)


class Fp8Net(nn.Module):
    """Two blocks and a head in the root unit. The head has 3 rows for the tensorwise recipes,
    so with 4 ranks one shard of it is empty; blockwise keeps it bf16 (3 is no block multiple)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16, out: int = 3, recompute: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Fp8Block(dtype, recompute) for _ in range(2)])
        self.head = nn.Linear(D, out, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(recipe: str | None, fp8_params: bool = True, meta: bool = False, seed: int = 0,
          recompute: bool = False, init_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The model (``recipe=None``: plain bf16), same weights for the same seed, eager or meta;
    ``recompute``: each block's MLP recomputed in the backward. ``init_dtype=torch.float32`` draws
    the weights in fp32 and casts (the golden cells: their bits then do not depend on torch's bf16
    random path); meta init materialises in bf16, so the default keeps eager and meta alike."""
    if meta and init_dtype != torch.bfloat16:
        raise ValueError(f"init_dtype={init_dtype} needs meta=False (meta init materialises in bf16)")
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            model = Fp8Net(recompute=recompute)
    else:
        model = Fp8Net(dtype=init_dtype, recompute=recompute).to(torch.bfloat16)
    if recipe is None:
        return model
    keep_head = recipe == "blockwise"
    return convert_to_fp8(model, RECIPES[recipe](), fp8_params=fp8_params,
                          module_filter=(lambda name, m: name != "head") if keep_head else None)


def batch(step: int, slot: int, micro: int, out: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Data slot ``slot`` (a rank's position in its data group) of microbatch ``micro``."""
    gen = torch.Generator().manual_seed(1000 * step + 10 * slot + micro)
    x = torch.randn(LOCAL_BATCH, SEQ, D, generator=gen).to(torch.bfloat16)
    return x, torch.randn(LOCAL_BATCH, SEQ, out, generator=gen)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target)


@dataclass
class RunResult:
    losses: list[float]
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # full fp32 main params (CPU)


def train_reference(model: nn.Module, slots: int, steps: int, micro: int, device: torch.device,
                    lr: float = 1e-2, first: int = 0) -> RunResult:
    """Emulated data parallelism over ``slots`` ranks (see the module docstring)."""
    model = model.to(device)
    named = list(model.named_parameters())
    masters = [nn.Parameter(p.detach().float()) for _, p in named]
    opt = torch.optim.Adam(masters, lr=lr)
    delayed = delayed_quantizers(model)
    set_deferred(delayed)
    losses = []
    for step in range(first, first + steps):
        with torch.no_grad():
            for (_, p), m in zip(named, masters, strict=True):
                p.copy_(m)
        grads = [torch.zeros_like(m) for m in masters]
        totals = [torch.zeros((), device=device) for _ in range(slots)]  # each rank's fp32 loss sum
        for m in range(micro):
            per_rank = []
            for slot in range(slots):
                x, y = (t.to(device) for t in batch(step, slot, m))
                loss = loss_fn(model(x), y) / micro
                loss.backward()
                totals[slot] += loss.detach()
                per_rank.append([p.grad.float() for _, p in named])
                model.zero_grad(set_to_none=True)
            for i, g in enumerate(grads):
                g.add_(torch.stack([r[i] for r in per_rank]).sum(0) / slots)
        advance_all(delayed, pack_pending(delayed))
        for m_, g in zip(masters, grads, strict=True):
            m_.grad = g
        opt.step()
        opt.zero_grad()
        losses.append((torch.stack(totals).sum() / slots).item())
    return RunResult(losses, {n: m.detach().cpu() for (n, _), m in zip(named, masters, strict=True)})


def wrap(model: nn.Module, strategy: Any = 3, meta: bool = False, lr: float = 1e-2,
         **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    kwargs.setdefault("mixed_precision_policy", fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32))
    return fsdp_impl.fully_shard(model, opt, fsdp_unit_modules=[Fp8Block], zero_dp_strategy=strategy,
                                 init_model_with_meta_device=meta, **kwargs)


def train_fsdp(model: nn.Module, opt: torch.optim.Optimizer, slot: int, steps: int, micro: int,
               device: torch.device, first: int = 0,
               record: Callable[[int, int], contextlib.AbstractContextManager | None] | None = None) -> list[float]:
    """This rank's part of the run (data slot ``slot``); returns the global per-step losses."""
    def microbatches(step: int) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        out = []
        for m in range(micro):
            x, y = batch(step, slot, m)
            out.append(([x.to(device)], y.to(device)))
        return out

    return train_accumulating(model, opt, steps, microbatches, loss_fn, device, record=record, first=first)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().float().cpu() for n, p in model.module.named_parameters()}
