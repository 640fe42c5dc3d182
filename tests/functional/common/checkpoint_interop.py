"""Runs of FSDP2 (``torch.distributed.fsdp.fully_shard``) and of our engine on the same model and
data, saving and resuming each other's checkpoints (``test_checkpoint_interop.py``).

The model is ``SmallGPT`` (tied embedding) with a two-group AdamW (decay / no decay, different
learning rates), trained on fixed global batches split into equal per-rank slices. Our engine
and FSDP2 train it bit-identically on CPU gloo (same full-parameter forward, same reduction
order at a given world size, element-wise AdamW on identically chunked Shard(0) rows), so a
continuation from one checkpoint must agree bit for bit whichever engine runs it.

``produce_on(world, root)`` starts ``world`` gloo processes of its own that train ``K_SAVE``
steps and leave four checkpoints under ``root``: FSDP2 in ``get_state_dict``'s layout
(``fsdp2_torch``), FSDP2 in torchtitan's layout (``fsdp2_titan``: model keys at the top level,
flattened optimizer, lr-scheduler / data-loader / train-state entries), and ours with
``format="torch_dcp"`` from ZeRO-3 (``ours_zero3``) and HSDP 2x2 (``ours_hsdp``; world 4 only).
Next to each, ``<name>.state.pt`` records the full state at the save (the reference right after
a load).
"""
from __future__ import annotations

import dataclasses
import functools
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

import fsdp_impl
from fsdp_impl import checkpoint

from .mesh import seed_kwargs, seed_mesh
from .models import GPTBlock, build_model, loss_fn, make_batch

K_SAVE = 3  # steps before the save: Adam's step count in the checkpoint is 3
N_AFTER = 10  # steps every continuation trains
GLOBAL_BATCH = 8
LR, DECAY = 1e-2, 0.1
RESUME_LR = 0.5  # resumed runs are built with it: the checkpoint's lr must replace it
TITAN = StateDictOptions(flatten_optimizer_state_dict=True)
FSDP2_LAYOUTS = ("fsdp2_torch", "fsdp2_titan")


@dataclasses.dataclass(frozen=True)
class Ours:
    """Our engine's configuration: ZeRO strategy and HSDP outer strategy (None: plain FSDP)."""

    zero: int
    outer: str | None = None

    def __str__(self) -> str:
        return f"zero{self.zero}" + (f"-hsdp_{self.outer}" if self.outer else "")


def adamw(named: list[tuple[str, nn.Parameter]], lr: float = LR) -> torch.optim.AdamW:
    """Matrices decay at ``lr``; vectors do not, at ``lr / 2`` (the groups must survive a load).
    A resumed run is built with another ``lr``: the checkpoint's hyperparameters must replace it."""
    decay = [p for n, p in named if p.dim() >= 2]
    rest = [p for n, p in named if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": DECAY},
                              {"params": rest, "weight_decay": 0.0, "lr": lr / 2}], lr=lr)


@functools.cache
def _fsdp2_mesh(outer: int, shard: int) -> Any:
    mesh = seed_mesh((outer, shard, 1, 1), "cpu")
    return mesh["dp_outer", "dp_shard"] if outer > 1 else mesh["dp_shard"]


def fsdp2(seed: int, outer: int = 1, lr: float = LR) -> tuple[nn.Module, torch.optim.Optimizer]:
    """SmallGPT under FSDP2: ``fully_shard`` per block and on the root (HSDP over ``outer`` replicas)."""
    from torch.distributed.fsdp import fully_shard

    module = build_model("gpt", seed=seed)
    mesh = _fsdp2_mesh(outer, dist.get_world_size() // outer)
    for block in module.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module, adamw(list(module.named_parameters()), lr)


def ours(seed: int, config: Ours, lr: float = LR) -> tuple[nn.Module, torch.optim.Optimizer]:
    module = build_model("gpt", seed=seed)
    kwargs: dict[str, Any] = dict(fsdp_unit_modules=[GPTBlock], zero_dp_strategy=config.zero)
    if config.outer is not None:
        world = dist.get_world_size()
        kwargs.update(seed_kwargs(seed_mesh((2, world // 2, 1, 1), "cpu"), config.outer))
    return fsdp_impl.fully_shard(module, adamw(list(module.named_parameters()), lr), **kwargs)


def train(model: nn.Module, optimizer: Any, steps: range) -> list[float]:
    """Each step on this rank's slice of the fixed global batch; returns the global mean losses."""
    rank, world = dist.get_rank(), dist.get_world_size()
    part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    losses = []
    for step in steps:
        (idx,), target = make_batch("gpt", GLOBAL_BATCH, seed=1000 + step)
        loss = loss_fn("gpt")(model(idx[part]), target[part])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_state(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Full params, AdamW moments and step counts under the module's own names (collective)."""
    inner = getattr(model, "module", model) if hasattr(model, "_fsdp_engine") else model
    out: dict[str, torch.Tensor] = {}
    for name, p in inner.named_parameters():
        out[name] = p.full_tensor().detach().clone()
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{name}:{key}"] = state[key].full_tensor().detach().clone()
        if "step" in state:
            out[f"{name}:step"] = torch.as_tensor(state["step"]).detach().clone()
    return out


def save_fsdp2(model: nn.Module, optimizer: Any, path: Path, layout: str) -> None:
    """FSDP2's checkpoint as its users write it: ``get_state_dict``'s, or torchtitan's layout."""
    if layout == "fsdp2_torch":
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    state: dict[str, Any] = dict(get_model_state_dict(model))
    state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=TITAN)
    state["lr_scheduler"] = {"last_epoch": K_SAVE}
    state["train_state"] = {"step": K_SAVE, "ntokens_seen": K_SAVE * GLOBAL_BATCH * 6}
    state["dataloader"] = {"version": 1, "dp_world_size": world, f"dp_rank_{rank}": {"consumed": K_SAVE}}
    dcp.save(state, checkpoint_id=str(path))


def resume_fsdp2(path: Path, layout: str, outer: int = 1) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A fresh FSDP2 run (other init) resumed from ``path`` the way FSDP2 users resume."""
    model, optimizer = fsdp2(seed=99, outer=outer, lr=RESUME_LR)
    if layout == "fsdp2_titan":
        model_sd = get_model_state_dict(model)
        state: dict[str, Any] = dict(model_sd)
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=TITAN)
        dcp.load(state, checkpoint_id=str(path))
        set_model_state_dict(model, {k: state[k] for k in model_sd})
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=TITAN)
        return model, optimizer
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, optimizer


def _record(model: nn.Module, optimizer: Any, path: Path) -> None:
    state = full_state(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(state, path.with_name(path.name + ".state.pt.partial"))
        os.replace(path.with_name(path.name + ".state.pt.partial"), path.with_name(path.name + ".state.pt"))


def _produce(rank: int, world: int, store: str, root: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out = Path(root)
        model, optimizer = fsdp2(seed=0)
        train(model, optimizer, range(K_SAVE))
        for layout in FSDP2_LAYOUTS:
            save_fsdp2(model, optimizer, out / layout, layout)
            _record(model, optimizer, out / layout)
        configs = [("ours_zero3", Ours(3))] + ([("ours_hsdp", Ours(3, "no_shard"))] if world == 4 else [])
        for name, config in configs:
            model, optimizer = ours(seed=0, config=config)
            train(model, optimizer, range(K_SAVE))
            checkpoint.save(out / name, model, optimizer, extra={"step": K_SAVE}, format="torch_dcp")
            _record(model, optimizer, out / name)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def produce_on(world: int, root: Path) -> None:
    """The checkpoints of the module docstring, written by ``world`` fresh gloo processes (CPU).
    Call from one rank only; raises if any process fails."""
    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    store.unlink(missing_ok=True)
    mp.start_processes(_produce, args=(world, str(store), str(root)), nprocs=world, join=True,
                       start_method="spawn")
