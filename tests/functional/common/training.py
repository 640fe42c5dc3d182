"""The distributed side of the parity tests: train a ``fully_shard``-ed copy of a shared model on
this rank's slice of the same global batches the reference sees."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

import fsdp_impl
from .models import build_model, loss_fn, unit_classes
from .reference import global_batch, make_optimizer


@dataclass
class RunConfig:
    model: str = "cnn"
    optimizer: str = "adam"
    strategy: object = 3
    dtype: torch.dtype = torch.float32  # compute dtype of the module
    main_dtype: Optional[torch.dtype] = torch.float32
    microbatches: int = 1
    meta_init: bool = False
    steps: int = 5
    local_batch: int = 3
    seed: int = 0
    lr: float = 1e-2


def local_slice(t: torch.Tensor, rank: int, per_rank: int) -> torch.Tensor:
    return t[rank * per_rank:(rank + 1) * per_rank]


def train_fsdp(cfg: RunConfig, device: torch.device, model: Optional[torch.nn.Module] = None,
               **fsdp_kwargs) -> Tuple[List[float], Dict[str, torch.Tensor], "torch.nn.Module"]:
    """Train with FSDP; return the global per-step losses, full final params and the model.

    ``model`` overrides the freshly built ``cfg.model`` (e.g. with frozen params); extra keyword
    arguments go to ``fully_shard``.
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
    losses: List[float] = []
    for step in range(cfg.steps):
        inputs, target = global_batch(cfg.model, step, world * cfg.local_batch, cfg.dtype)
        inputs = [local_slice(x, rank, cfg.local_batch).to(device) for x in inputs]
        target = local_slice(target, rank, cfg.local_batch).to(device)
        total = torch.zeros((), device=device)
        for m in range(cfg.microbatches):
            fsdp_model.set_model_auto_sync(m == cfg.microbatches - 1)
            xs = [local_slice(x, m, micro) for x in inputs]
            loss = loss_fn(cfg.model)(fsdp_model(*xs), local_slice(target, m, micro)) / cfg.microbatches
            loss.backward()
            total += loss.detach()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
        opt.step()
        opt.zero_grad()
    final = {n: p.full_tensor().detach().cpu() for n, p in fsdp_model.module.named_parameters()}
    return losses, final, fsdp_model
