"""Checkpoints across nodes: DCP save, load and resume with every rank of every node writing into one
shared directory, resume equal to uninterrupted training bit for bit.

The world follows torchrun's ``WORLD_SIZE`` (the nodes times the ranks per node of a multi-node run,
``launch_scripts/<gen>/slurm/``), and is 4 under plain pytest. The HSDP cases use a (dp_outer=2,
dp_shard=world/2) mesh: on two nodes the shard groups are the nodes and the outer (replicate)
dimension pairs each rank with its counterpart on the other node, so that all-reduce crosses the
network. CI runs the suite as two torchrun "nodes" x 2 gloo ranks
(``tests/unit/harness/test_harness_multinode.py``); a multi-node job runs it at its own world size.

Each case trains ``N_STEPS`` steps of two-group Adam uninterrupted, saving after ``K_SAVE``
(``fsdp_impl.checkpoint.save`` into ``shared_tmp_path``, on a filesystem every node mounts), then
wraps a fresh model (another seed, an optimizer with another learning rate), runs a forward, loads,
and checks: every rank sees one DCP data file per rank of the whole world (the directory really is
shared: a node-local directory would hold its own node's files only); right after the load the
parameters, Adam moments and step counts equal the saved ones bit for bit; the resumed losses and
final state equal the uninterrupted run's bit for bit (CPU fp32, the same arithmetic in the same
order). Batches hold 2 samples per rank whatever the world, so every rank has data.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_impl import checkpoint
from tests.functional import matrix_axes as axes
from tests.functional.common.checkpointing import (
    K_SAVE,
    N_STEPS,
    Case,
    assert_same_state,
    full_state,
    learning_rates,
    train_with_checkpoint,
    wrap,
)
from tests.functional.common.models import loss_fn, make_batch

WORLD = int(os.environ.get("WORLD_SIZE") or 4)
NODES = int(os.environ.get("GROUP_WORLD_SIZE") or 1)
RESUME_LR = 0.5  # a fresh optimizer with the wrong lr: the load must restore the saved one
PER_RANK = 2


def _mesh(case: Case) -> str:
    return axes.mesh(WORLD) if case.outer is None else axes.mesh(WORLD // 2, outer=2)


def _param(case: Case, fast: bool) -> Any:
    marks = [pytest.mark.matrix(mesh=_mesh(case), zero=case.strategy, outer=case.outer, model=case.model,
                                dtype="fp32")]
    if not fast:
        marks.append(pytest.mark.slow)
    return pytest.param(case, marks=marks, id=f"{case.strategy}-outer_{case.outer or 'none'}")


CASES = [_param(Case("cnn", "optim_grads_params"), fast=True),
         _param(Case("cnn", "optim_grads_params", "optim"), fast=True),  # HFSDP: outer across nodes
         _param(Case("cnn", "no_shard"), fast=False),
         _param(Case("cnn", "optim"), fast=False),
         _param(Case("cnn", "optim_grads"), fast=False),
         _param(Case("cnn", "optim_grads", "no_shard"), fast=False)]


def _step(model: torch.nn.Module, optimizer: Any, step: int, device: torch.device) -> float:
    """One step on this rank's slice of the fixed global batch of ``step``; returns the global loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, target = make_batch("cnn", PER_RANK * world, seed=1000 + step)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss = loss_fn("cnn")(model(*[x[part].to(device) for x in inputs]), target[part].to(device))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    total = loss.detach().reshape(1).clone()
    dist.all_reduce(total)  # equal slices: the mean of the slice means is the full-batch mean
    return total.item() / world


def _data_files_seen_by_every_rank(target: Path) -> list[list[str]]:
    """Every rank's listing of the checkpoint's DCP data files (gathered), with its node."""
    mine = sorted(p.name for p in checkpoint.data_dir(target).glob("*.distcp"))
    node = os.environ.get("GROUP_RANK", "0")
    seen: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen, [node, *mine])
    return seen


@pytest.mark.distributed(world_size=WORLD, timeout=600)
@pytest.mark.parametrize("case", CASES)
def test_checkpoint_resume_across_nodes(case: Case, dist_env: Any, shared_tmp_path: Path) -> None:
    if WORLD % 2 and case.outer is not None:
        pytest.skip(f"HSDP needs an even world size, got {WORLD}")
    target = shared_tmp_path / "ckpt"
    model, optimizer = wrap(case, dist_env.device, seed=0)
    record = train_with_checkpoint(case, model, optimizer, dist_env.device, target, step_fn=_step)

    seen = _data_files_seen_by_every_rank(target)
    files = {tuple(s[1:]) for s in seen}
    assert len(files) == 1 and len(next(iter(files))) == WORLD, (
        f"the checkpoint directory is not one shared directory: per rank (node, files) {seen}")
    assert len({s[0] for s in seen}) == max(NODES, 1)  # every node's ranks took part

    model, optimizer = wrap(case, dist_env.device, seed=1234, lr=RESUME_LR)
    with torch.no_grad():  # compute weights now hold the random init; the load must refresh them
        inputs, _ = make_batch("cnn", PER_RANK, seed=999)
        model(*[x.to(dist_env.device) for x in inputs])
    extra = checkpoint.load(target, model, optimizer)
    assert extra["next_step"] == K_SAVE and extra["losses"] == record["losses"][:K_SAVE]
    assert learning_rates(optimizer) == record["lr"], "param-group hyperparameters not restored"
    assert_same_state(full_state(model, optimizer), record["at_save"], None, "right after load")

    losses = [_step(model, optimizer, s, dist_env.device) for s in range(K_SAVE, N_STEPS)]
    assert losses == record["losses"][K_SAVE:], f"resumed {losses} != uninterrupted {record['losses'][K_SAVE:]}"
    assert_same_state(full_state(model, optimizer), record["final"], None, "after resumed training")
