"""Single-process reference training that the distributed suites compare against.

The reference sees the *full* global batch every step (what all ranks together see) and, for a
low-precision model with fp32 main params, keeps fp32 master copies, casts them into the model
before each forward and steps the optimizer on the masters: the same arithmetic FSDP does,
without any sharding, microbatching or communication.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from .models import loss_fn, make_batch

OPTIMIZERS = ("adam", "sgd")


def make_optimizer(kind: str, named_params: Iterable[tuple[str, nn.Parameter]], lr: float = 1e-2
                   ) -> torch.optim.Optimizer:
    """Adam or SGD with two param groups: matrices (weight decay, ``lr``) and vectors (no decay,
    ``lr / 2``), so a test notices if groups or their hyper-parameters are lost.

    SGD matters: Adam is nearly invariant to a constant gradient scale, so a wrong reduction
    average would pass an Adam-only parity test.
    """
    decay, no_decay = [], []
    for name, p in named_params:
        (decay if p.dim() >= 2 and not name.endswith("bias") else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": 0.01, "lr": lr},
              {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9)
    raise ValueError(f"optimizer kind {kind!r} unknown; allowed values: {OPTIMIZERS}")


def global_batch(model_name: str, step: int, global_size: int, dtype: torch.dtype):
    """The fixed global batch of ``step`` (identical on every process)."""
    return make_batch(model_name, global_size, seed=1000 + step, dtype=dtype)


def piecewise_grads(model: nn.Module, named: list[tuple[str, nn.Parameter]], model_name: str,
                 inputs: list[torch.Tensor], target: torch.Tensor, split: tuple[int, int],
                 grad_dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The step's loss and grads computed piecewise as FSDP computes them: ``split = (ranks,
    microbatches)`` cuts the batch into equal contiguous pieces (rank-major); each piece's grad of
    ``loss / microbatches`` comes from its own forward/backward in the model's dtype, is cast to
    ``grad_dtype``, summed over a rank's microbatches and averaged over ranks, in this fixed
    order. ``split=(1, 1)`` is the plain full-batch grad."""
    ranks, micro = split
    n = target.shape[0]
    assert n % (ranks * micro) == 0, f"a batch of {n} does not split into {ranks} ranks x {micro} microbatches"
    size = n // (ranks * micro)
    total = torch.zeros((), dtype=torch.float32, device=target.device)
    grads: dict[str, torch.Tensor] = {}
    for r in range(ranks):
        rank_grads: dict[str, torch.Tensor] = {}
        for m in range(micro):
            piece = slice((r * micro + m) * size, (r * micro + m + 1) * size)
            value = loss_fn(model_name)(model(*[x[piece] for x in inputs]), target[piece]) / micro
            value.backward()
            total += value.detach().float()
            for name, p in named:
                if p.grad is not None:
                    g = p.grad.to(grad_dtype)
                    rank_grads[name] = rank_grads[name] + g if name in rank_grads else g
                    p.grad = None
        for name, g in rank_grads.items():
            grads[name] = grads[name] + g if name in grads else g
    return total / ranks, {name: g / ranks for name, g in grads.items()}


def train_reference(model: nn.Module, model_name: str, opt_kind: str, steps: int, global_size: int,
                    main_dtype: torch.dtype | None = None, lr: float = 1e-2, split: tuple[int, int] = (1, 1)
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train ``model`` on the global batches; return per-step losses and final (main) params by name.

    ``split = (ranks, microbatches)`` computes each step's loss and grad piecewise, with the
    arithmetic of FSDP (see ``piecewise_grads``); needed where the compute dtype is coarse: a bf16
    full-batch grad is rounded once, FSDP's pieces are rounded each, and the two differ by
    bf16 rounding (2^-9 relative per element), which Adam amplifies on small grads. Runs on the
    device ``model`` lives on (so a GPU run compares like kernels with like); the returned params
    are on the CPU.
    """
    compute_dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    named = list(model.named_parameters())
    separate = main_dtype is not None and main_dtype != compute_dtype
    masters = [(n, nn.Parameter(p.detach().to(main_dtype), requires_grad=p.requires_grad))
               for n, p in named] if separate else named
    opt = make_optimizer(opt_kind, masters, lr=lr)
    losses: list[float] = []
    for step in range(steps):
        if separate:
            with torch.no_grad():
                for (_, p), (_, m) in zip(named, masters, strict=True):
                    p.copy_(m)
        inputs, target = global_batch(model_name, step, global_size, compute_dtype)
        loss, grads = piecewise_grads(model, named, model_name, [x.to(device) for x in inputs], target.to(device),
                                   split, main_dtype if separate else compute_dtype)
        for name, m in masters:
            m.grad = grads.get(name)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: m.detach().cpu().clone() for n, m in masters}
