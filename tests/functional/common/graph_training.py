"""Model, data and loops shared by the CUDA-graph suite (GPU) and the graph-mode bookkeeping
tests (CPU): an MLP of Linear/LayerNorm/GELU units, whose kernels are deterministic (no
atomic-add backward: no embedding, no index_add), so two runs of the same steps agree bitwise.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdp_impl
from fsdp_impl.module import FullyShardedModule
from fsdp_impl.placement import local_tensor

IN, HIDDEN, OUT, LAYERS, LOCAL_BATCH = 12, 32, 3, 3, 4  # OUT=3 rows: uneven shards on 2 ranks


class Block(nn.Module):
    """``recompute``: the block's layers run under a non-reentrant ``torch.utils.checkpoint``."""

    def __init__(self, hidden: int, recompute: bool = False) -> None:
        super().__init__()
        self.recompute = recompute
        self.lin = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)

    def _layers(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.norm(self.lin(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            return x + checkpoint(self._layers, x, use_reentrant=False)
        return x + self._layers(x)


class GraphNet(nn.Module):
    """``inp`` and ``out`` live in the root unit; each ``Block`` is a unit."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, HIDDEN)
        self.blocks = nn.Sequential(*[Block(HIDDEN, recompute) for _ in range(LAYERS)])
        self.out = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


@dataclass(frozen=True)
class GraphCase:
    strategy: int
    outer: str | None = None  # None: plain FSDP; "no_shard": HSDP over (dp_outer=world, dp_shard=1)
    dtype: torch.dtype = torch.float32  # compute dtype (main params and grads are fp32)
    optimizer: str = "adamw"  # "adamw": fsdp_impl.optim.AdamW(capturable=True); "sgd": torch SGD(momentum)

    @property
    def id(self) -> str:
        outer = f"hsdp-{self.outer}" if self.outer else "plain"
        return f"zero{self.strategy}-{outer}-{str(self.dtype).removeprefix('torch.')}-{self.optimizer}"


_MESHES: dict[str, DeviceMesh] = {}


def hsdp_mesh(device_type: str) -> DeviceMesh:
    """(dp_outer = world, dp_shard = 1) with the flattened ``hsdp`` dim (one per rank process)."""
    if device_type not in _MESHES:
        mesh = init_device_mesh(device_type, (dist.get_world_size(), 1), mesh_dim_names=("dp_outer", "dp_shard"))
        mesh["dp_outer", "dp_shard"]._flatten("hsdp")
        _MESHES[device_type] = mesh
    return _MESHES[device_type]


def mesh_kwargs(case: GraphCase, device: torch.device) -> dict[str, Any]:
    if case.outer is None:
        return {}
    mesh = hsdp_mesh(device.type)
    return dict(device_mesh=mesh, dp_shard_dim="dp_shard", dp_outer_dim="dp_outer",
                hybrid_fsdp_group=mesh["hsdp"].get_group(), outer_dp_sharding_strategy=case.outer)


def make_optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "adamw":
        return fsdp_impl.optim.AdamW(params, lr=1e-2, weight_decay=0.01, capturable=True)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}")


def wrap(case: GraphCase, device: torch.device, graph_mode: bool, seed: int = 0, recompute: bool = False,
         **kwargs: Any) -> tuple[FullyShardedModule, torch.optim.Optimizer]:
    """The model of ``seed`` on ``device`` in the case's compute dtype, wrapped with fully_shard
    (``recompute``: every block recomputes its layers in the backward)."""
    torch.manual_seed(seed)
    module = GraphNet(recompute).to(device=device, dtype=case.dtype)
    opt = make_optimizer(case.optimizer, module.parameters())
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    return fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=case.strategy,
                                 mixed_precision_policy=policy, cuda_graph_mode=graph_mode,
                                 **mesh_kwargs(case, device), **kwargs)


def batch(step: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s (input, target) for this rank (different on every rank and step)."""
    gen = torch.Generator().manual_seed(10_000 * step + dist.get_rank())
    x = torch.randn(LOCAL_BATCH, IN, generator=gen)
    y = torch.randn(LOCAL_BATCH, OUT, generator=gen)
    return x.to(device=device, dtype=dtype), y.to(device)


def make_step_fn(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Forward, loss (fp32) and backward; returns the loss."""
    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        return loss
    return step_fn


def eager_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range, device: torch.device,
                dtype: torch.dtype, optimizer_step: bool = True) -> list[torch.Tensor]:
    """``zero_grad(set_to_none=False)``, step_fn, [``opt.step()``] per step; the losses."""
    step_fn = make_step_fn(model)
    losses = []
    for step in steps:
        opt.zero_grad(set_to_none=False)
        losses.append(step_fn(*batch(step, device, dtype)).detach().clone())
        if optimizer_step:
            opt.step()
    return losses


def warmup_then_steps(opt: torch.optim.Optimizer, step_fn: Callable[..., torch.Tensor], warm: tuple[torch.Tensor, ...],
                      warmup: int, batches: list[tuple[torch.Tensor, ...]]) -> list[torch.Tensor]:
    """The eager twin of ``capture_train_step`` + replays: ``warmup`` steps on ``warm`` (what the
    capture's warm-up runs), then one step per batch; each step is ``zero_grad(set_to_none=False)``,
    ``step_fn``, ``opt.step()``. Returns the per-batch losses."""
    for _ in range(warmup):
        opt.zero_grad(set_to_none=False)
        step_fn(*warm)
        opt.step()
    losses = []
    for b in batches:
        opt.zero_grad(set_to_none=False)
        losses.append(step_fn(*b).detach().clone())
        opt.step()
    return losses


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}


def local_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each param's local grad shard (a view of the grad buffer)."""
    return {n: local_tensor(p.grad) for n, p in model.module.named_parameters() if p.grad is not None}


def assert_params_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    if bad:
        n = bad[0]
        diff = (a[n].float() - b[n].float()).abs().max().item()
        raise AssertionError(f"{what}: {len(bad)} params differ, e.g. {n!r} by up to {diff:.3g}")
