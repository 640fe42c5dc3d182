"""The distributed side of the parity tests: train a ``fully_shard``-ed copy of a shared model on
this rank's slice of the same global batches the reference sees."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fsdp_impl

from .models import build_model, loss_fn, unit_classes
from .reference import global_batch, make_optimizer

Microbatch = tuple[Sequence[torch.Tensor], torch.Tensor]  # (model inputs, target) on the device
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Recorder = Callable[[int, int], AbstractContextManager | None]


@dataclass
class RunConfig:
    model: str = "cnn"
    optimizer: str = "adam"
    strategy: object = 3
    dtype: torch.dtype = torch.float32  # compute dtype of the module
    main_dtype: torch.dtype | None = torch.float32
    microbatches: int = 1
    meta_init: bool = False
    steps: int = 5
    local_batch: int = 3
    seed: int = 0
    lr: float = 1e-2


def local_slice(t: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    return t[rank * per_rank:(rank + 1) * per_rank]


def train_accumulating(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int,
                       microbatches: Callable[[int], Sequence[Microbatch]], loss: LossFn,
                       device: torch.device, record: Recorder | None = None, first: int = 0,
                       before_step: Callable[[int], None] | None = None) -> list[float]:
    """``steps`` optimisation cycles of gradient accumulation; return each step's global loss.

    Each cycle runs the microbatches ``microbatches(step)`` gives this rank with auto-sync off
    except on the last one (so grads are reduced once per cycle, as users accumulate), each loss
    divided by their number, then ``opt.step()``/``zero_grad()``. The returned loss is the
    rank-average of the accumulated loss, i.e. the full-batch loss when ranks hold equal slices.
    ``record(step, m)`` may return a context (e.g. a ``CollectiveCounter``) entered around
    microbatch ``m``'s forward and backward only, so it sees the engine's traffic and not the
    loss all-reduce. Steps are numbered from ``first`` (to resume a run); ``before_step(step)``
    runs after the sync backward, before ``opt.step()`` (to inspect the synced grads).
    """
    losses: list[float] = []
    for step in range(first, first + steps):
        batches = microbatches(step)
        total = torch.zeros((), device=device)
        for m, (xs, target) in enumerate(batches):
            model.set_model_auto_sync(m == len(batches) - 1)
            context = record(step, m) if record is not None else None
            with context if context is not None else contextlib.nullcontext():
                value = loss(model(*xs), target) / len(batches)
                value.backward()
            total += value.detach()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
        if before_step is not None:
            before_step(step)
        opt.step()
        opt.zero_grad()
    return losses


def train_fsdp(cfg: RunConfig, device: torch.device, model: torch.nn.Module | None = None,
               record: Recorder | None = None, **fsdp_kwargs
               ) -> tuple[list[float], dict[str, torch.Tensor], torch.nn.Module]:
    """Train with FSDP; return the global per-step losses, full final params and the model.

    ``model`` overrides the freshly built ``cfg.model`` (e.g. with frozen params); ``record`` is
    ``train_accumulating``'s; extra keyword arguments go to ``fully_shard``.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if model is None:
        model = build_model(cfg.model, cfg.dtype, cfg.seed, device="meta" if cfg.meta_init else None)
    opt = make_optimizer(cfg.optimizer, model.named_parameters(), lr=cfg.lr)
    kwargs = dict(fsdp_unit_modules=list(unit_classes(cfg.model)), zero_dp_strategy=cfg.strategy,
                  init_model_with_meta_device=cfg.meta_init,
                  mixed_precision_policy=fsdp_impl.MixedPrecisionPolicy(main_params_dtype=cfg.main_dtype))
    kwargs.update(fsdp_kwargs)
    fsdp_model, opt = fsdp_impl.fully_shard(model, opt, **kwargs)
    micro = cfg.local_batch // cfg.microbatches

    def microbatches(step: int) -> list[Microbatch]:
        inputs, target = global_batch(cfg.model, step, world * cfg.local_batch, cfg.dtype)
        inputs = [local_slice(x, rank, cfg.local_batch).to(device) for x in inputs]
        target = local_slice(target, rank, cfg.local_batch).to(device)
        return [([local_slice(x, m, micro) for x in inputs], local_slice(target, m, micro))
                for m in range(cfg.microbatches)]

    losses = train_accumulating(fsdp_model, opt, cfg.steps, microbatches, loss_fn(cfg.model), device, record)
    final = {n: p.full_tensor().detach().cpu() for n, p in fsdp_model.module.named_parameters()}
    return losses, final, fsdp_model
