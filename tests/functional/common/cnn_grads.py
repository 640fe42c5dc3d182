"""One synced backward of the small CNN under ``fully_shard`` against a single-process reference
of the same objective on the global batch (the drop-in argument and expert-parallel suites).

With the default reduction and with ``average_in_collective`` the grads are the mean over ranks,
with ``calculate_per_token_loss`` the sum. A factor-of-world error is 100% relative, far above
``RTOL`` (the measured difference is fp32 summation order, <= 1e-6).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp_impl import fully_shard

from .models import build_model, loss_fn, make_batch

UNITS = [nn.Conv2d, nn.Linear]
RTOL = 1e-5
LOCAL_BATCH = 3


def local_batch(dist_env: Any, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's ``LOCAL_BATCH`` samples of the global batch ``seed``."""
    (x,), y = make_batch("cnn", LOCAL_BATCH * dist_env.world_size, seed)
    r = dist_env.rank * LOCAL_BATCH
    return x[r:r + LOCAL_BATCH].to(dist_env.device), y[r:r + LOCAL_BATCH].to(dist_env.device)


def reference_grads(world: int, reduction: str, seed: int = 5) -> dict[str, torch.Tensor]:
    """Grads of ``mean`` (or ``sum``) over ranks of each rank's loss, on one process."""
    model = build_model("cnn")
    (x,), y = make_batch("cnn", LOCAL_BATCH * world, seed)
    losses = [loss_fn("cnn")(model(x[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH]), y[r * LOCAL_BATCH:(r + 1) * LOCAL_BATCH])
              for r in range(world)]
    total = torch.stack(losses).sum()
    (total if reduction == "sum" else total / world).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def fsdp_grads(dist_env: Any, **kwargs: Any) -> dict[str, torch.Tensor]:
    """The full synced grads of one backward of the wrapped CNN (``kwargs`` go to ``fully_shard``)."""
    model = build_model("cnn")
    fsdp, _ = fully_shard(model, torch.optim.SGD(model.parameters(), lr=0.1), fsdp_unit_modules=UNITS, **kwargs)
    x, y = local_batch(dist_env)
    loss_fn("cnn")(fsdp(x), y).backward()
    return {n: p.grad.full_tensor().cpu() for n, p in fsdp.module.named_parameters()}


def assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    for name, e in expected.items():
        err = ((actual[name] - e).norm() / e.norm().clamp_min(1e-12)).item()
        assert err <= RTOL, f"{what}: {name} relative error {err:.3g}"
