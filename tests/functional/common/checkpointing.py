"""Training, state capture and comparison for the checkpoint suites (``test_checkpoint_resume.py``,
``test_checkpoint_dist_errors.py``).

A run trains ``N_STEPS`` steps of two-group Adam on fixed global batches, each rank on its equal
slice, and can save after ``K_SAVE`` steps. ``full_state`` captures everything a resume must
restore (global params, Adam moments and step counts, by name) so that two runs can be compared
bit for bit. ``save_in_spawned_world`` produces checkpoints on another world size than the
calling bucket's: it starts that many gloo processes of its own (CPU), so a test that loads a
checkpoint from another world size never waits for another bucket.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fsdp_impl
from fsdp_impl import checkpoint

from .mesh import seed_kwargs, seed_mesh
from .models import build_model, loss_fn, make_batch, unit_classes
from .numerics import relative_error
from .reference import make_optimizer

K_SAVE = 2
N_STEPS = 4
GLOBAL_BATCH = 8  # divisible by every world size used here: all ranks get equal slices
LR = 1e-2
RECORD = "record.pt"


@dataclasses.dataclass(frozen=True)
class Case:
    """One training configuration: model x ZeRO strategy x outer (HSDP) strategy."""

    model: str
    strategy: str
    outer: str | None = None

    def __str__(self) -> str:
        return f"{self.model}-{self.strategy}-outer_{self.outer or 'none'}"


def wrap(case: Case, device: torch.device, seed: int, lr: float = LR) -> tuple:
    """A freshly built, wrapped model and a never-stepped two-group Adam. Outer strategies run
    on a (dp_outer=2, dp_shard=world/2) mesh."""
    module = build_model(case.model, seed=seed)
    optimizer = make_optimizer("adam", module.named_parameters(), lr=lr)
    kwargs: dict[str, Any] = dict(fsdp_unit_modules=list(unit_classes(case.model)), zero_dp_strategy=case.strategy)
    if case.outer is not None:
        kwargs.update(seed_kwargs(seed_mesh((2, dist.get_world_size() // 2, 1, 1), device.type), case.outer))
    return fsdp_impl.fully_shard(module, optimizer, **kwargs)


def local_inputs(model_name: str, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """This rank's equal slice of the fixed global batch ``seed`` (inputs, target) on the CPU."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, target = make_batch(model_name, GLOBAL_BATCH, seed=seed)
    part = slice(rank * (GLOBAL_BATCH // world), (rank + 1) * (GLOBAL_BATCH // world))
    return [x[part] for x in inputs], target[part]


def train_step(model: torch.nn.Module, optimizer: Any, model_name: str, step: int,
               device: torch.device) -> float:
    """One step on this rank's slice of the fixed global batch of ``step``; returns the global loss."""
    inputs, target = local_inputs(model_name, 1000 + step)
    loss = loss_fn(model_name)(model(*[x.to(device) for x in inputs]), target.to(device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)  # mean of equal-size slice means == full-batch mean
    return total.item() / dist.get_world_size()


def probe_forward(model: torch.nn.Module, model_name: str, device: torch.device) -> None:
    """An evaluation forward before a load, so the engine has already built compute weights
    from the random init: the resumed losses then prove that the load refreshed them."""
    inputs, _ = local_inputs(model_name, 999)
    with torch.no_grad():
        model(*[x.to(device) for x in inputs])


def full(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy of the global tensor (a collective for DTensors: call in the same order)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().cpu().clone()


def full_state(model: torch.nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    """Global params, Adam moments and step counts by name (collective, fixed order)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = full(p)
        state = optimizer.state.get(p, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if key in state:
                out[f"{name}:{key}"] = full(state[key])
        if "step" in state:
            out[f"{name}:step"] = torch.as_tensor(state["step"]).detach().cpu().clone()
    return out


def learning_rates(optimizer: Any) -> list[float]:
    return [float(g["lr"]) for g in optimizer.param_groups]


def assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                      rtol: float | None, what: str) -> None:
    """Bit-for-bit (``rtol=None``) or per-tensor ``relative_error``, naming the first bad tensor."""
    assert actual.keys() == expected.keys(), f"{what}: state entries differ: {sorted(actual.keys() ^ expected.keys())}"
    for name, e in expected.items():
        a = actual[name]
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}: {name} {a.shape}/{a.dtype} vs {e.shape}/{e.dtype}"
        if rtol is None:
            assert torch.equal(a, e), f"{what}: {name} differs (max abs {(a - e).abs().max().item():.3e})"
        else:
            err = relative_error(a, e)
            assert err <= rtol, f"{what}: {name} relative error {err:.3e} > {rtol}"


def train_with_checkpoint(case: Case, model: torch.nn.Module, optimizer: Any, device: torch.device,
                          target: Path, step_fn: Any = None) -> dict[str, Any]:
    """The uninterrupted run: ``N_STEPS`` steps, saving to ``target`` before step ``K_SAVE``.
    Returns the record a resume is checked against: per-step losses, the state at the save and
    at the end, and the learning rates. ``step_fn(model, optimizer, step, device) -> loss``
    replaces ``train_step`` (a suite with its own data split)."""
    losses: list[float] = []
    at_save: dict[str, torch.Tensor] = {}
    for step in range(N_STEPS):
        if step == K_SAVE:
            checkpoint.save(target, model, optimizer, extra={"next_step": step, "losses": list(losses)})
            at_save = full_state(model, optimizer)
        losses.append(step_fn(model, optimizer, step, device) if step_fn is not None
                      else train_step(model, optimizer, case.model, step, device))
    return {"losses": losses, "at_save": at_save, "final": full_state(model, optimizer),
            "lr": learning_rates(optimizer)}


def case_dir(root: Path, case: Case) -> Path:
    return root / str(case)


def _produce(rank: int, world: int, store_path: str, cases: list[Case], root: str) -> None:
    """One process of a spawned gloo world: the uninterrupted run of every case, saving each
    checkpoint under ``root`` and (rank 0) its record next to it."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    try:
        device = torch.device("cpu")
        for case in cases:
            target = case_dir(Path(root), case)
            model, optimizer = wrap(case, device, seed=0)
            record = train_with_checkpoint(case, model, optimizer, device, target / "ckpt")
            if rank == 0:
                torch.save(record, target / (RECORD + ".partial"))
                os.replace(target / (RECORD + ".partial"), target / RECORD)
            dist.barrier()
    finally:
        dist.destroy_process_group()


def save_in_spawned_world(world: int, cases: list[Case], root: Path) -> None:
    """Run ``cases`` uninterrupted on ``world`` fresh gloo processes (CPU), leaving each case's
    checkpoint and record under ``root``; raises if any process fails. Call from one rank only."""
    root.mkdir(parents=True, exist_ok=True)
    store = root / "store"
    store.unlink(missing_ok=True)
    mp.start_processes(_produce, args=(world, str(store), cases, str(root)), nprocs=world, join=True,
                       start_method="spawn")
