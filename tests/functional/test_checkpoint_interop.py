"""Checkpoints that cross engines: FSDP2 (and torchtitan's layout of it) into ours, ours into FSDP2.

The checkpoints come from another world size: 4 gloo processes that rank 0 of this 2-rank
bucket spawns once (``checkpoint_interop.produce_on``), training ``K_SAVE`` = 3 steps of SmallGPT
with a two-group AdamW before saving (so the checkpoint holds AdamW moments and step count 3).

* FSDP2 in: FSDP2 (world 4) saves; ours at world 2 loads it (ZeRO-0 to 3, HSDP and HFSDP over 2
  replicas) and trains 10 steps; the reference is FSDP2 itself resumed at world 2 from the same
  checkpoint.
* FSDP2 out: ours (world 4, ZeRO-3 or HSDP 2x2) saves with ``format="torch_dcp"``; FSDP2 at world
  2 resumes it with ``get_state_dict`` + ``dcp.load`` + ``set_state_dict`` and trains 10 steps;
  the reference is ours resumed at world 2 from the same checkpoint.

Both engines train this model bit-identically at a given world size on CPU (same forward on full
parameters, same reduction order, element-wise AdamW on identically chunked rows), so every
comparison is exact: right after the load the state equals the recorded state at the save; after
10 steps every loss, parameter, moment and step count equals the other engine's. A wrong step
count changes Adam's bias correction (~1e-3 relative), lost moments or hyperparameters (the two
groups have different lr) change the first loss.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_impl import checkpoint
from tests.functional import matrix_axes as axes
from tests.functional.common.checkpoint_interop import (
    K_SAVE,
    LR,
    N_AFTER,
    RESUME_LR,
    Ours,
    full_state,
    ours,
    produce_on,
    resume_fsdp2,
    train,
)
from tests.functional.common.checkpointing import assert_same_state

SAVED_WORLD = 4
pytestmark = [pytest.mark.distributed(world_size=2, bucket="ckpt-interop", timeout=600),
              pytest.mark.matrix(model="gpt", dtype="fp32")]

_PRODUCED: dict[str, Path] = {}  # per rank process: the world-4 checkpoints of this bucket
_FSDP2_RUNS: dict[str, tuple[list[float], dict[str, torch.Tensor]]] = {}


def produced(session_dir: Path) -> Path:
    """The directory of the world-4 checkpoints; rank 0 produces it on the first call of the bucket."""
    if "root" not in _PRODUCED:
        outcome: list[Any] = [f"interop-ws{SAVED_WORLD}-{uuid.uuid4().hex[:12]}", None]
        if dist.get_rank() == 0:
            try:
                produce_on(SAVED_WORLD, session_dir / outcome[0])
            except Exception as exc:  # reported on every rank below, so all ranks fail alike
                outcome[1] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(outcome, src=0)
        if outcome[1] is not None:
            raise RuntimeError(f"producing the checkpoints on {SAVED_WORLD} spawned ranks failed: {outcome[1]}")
        _PRODUCED["root"] = session_dir / outcome[0]
    return _PRODUCED["root"]


def _saved_state(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path.with_name(path.name + ".state.pt"), weights_only=True)


def fsdp2_continuation(path: Path, layout: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """FSDP2 resumed at this world size from ``path``, 10 steps (cached per checkpoint)."""
    if str(path) not in _FSDP2_RUNS:
        model, optimizer = resume_fsdp2(path, layout)
        assert [g["lr"] for g in optimizer.param_groups] == [LR, LR / 2], "FSDP2 restored other learning rates"
        assert_same_state(full_state(model, optimizer), _saved_state(path), None, "FSDP2 right after its load")
        losses = train(model, optimizer, range(K_SAVE, K_SAVE + N_AFTER))
        _FSDP2_RUNS[str(path)] = (losses, full_state(model, optimizer))
    return _FSDP2_RUNS[str(path)]


def our_continuation(path: Path, config: Ours, expected_extra: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Ours (fresh init, an evaluation forward first) loads ``path`` and trains 10 steps."""
    model, optimizer = ours(seed=1234, config=config, lr=RESUME_LR)
    train_probe = torch.randint(0, 13, (2, 6))
    with torch.no_grad():
        model(train_probe)  # compute weights now hold the random init: the load must refresh them
    extra = checkpoint.load(path, model, optimizer)
    assert extra == expected_extra, extra
    after_load = full_state(model, optimizer)
    assert_same_state(after_load, _saved_state(path), None, "ours right after the load")
    assert {float(v) for k, v in after_load.items() if k.endswith(":step")} == {float(K_SAVE)}
    assert [g["lr"] for g in optimizer.param_groups] == [LR, LR / 2], "the checkpoint's learning rates"
    return train(model, optimizer, range(K_SAVE, K_SAVE + N_AFTER)), full_state(model, optimizer)


TITAN_EXTRA = {"lr_scheduler": {"last_epoch": K_SAVE}, "train_state": {"step": K_SAVE, "ntokens_seen": K_SAVE * 48},
               "dataloader": {"version": 1, "dp_world_size": SAVED_WORLD,
                              **{f"dp_rank_{r}": {"consumed": K_SAVE} for r in range(SAVED_WORLD)}}}
SLOW = pytest.mark.slow


def _in_axes(config: Ours) -> pytest.MarkDecorator:
    mesh = axes.mesh(1, outer=2) if config.outer else axes.mesh(2)
    return pytest.mark.matrix(mesh=mesh, zero=axes.zero(config.zero), outer=config.outer)


IN = [pytest.param("fsdp2_torch", Ours(3), marks=[_in_axes(Ours(3))], id="fsdp2_torch-zero3"),
      pytest.param("fsdp2_torch", Ours(1), marks=[_in_axes(Ours(1)), SLOW], id="fsdp2_torch-zero1"),
      pytest.param("fsdp2_torch", Ours(3, "no_shard"), marks=[_in_axes(Ours(3, "no_shard")), SLOW],
                   id="fsdp2_torch-zero3-hsdp_no_shard"),
      pytest.param("fsdp2_torch", Ours(0), marks=[_in_axes(Ours(0)), SLOW], id="fsdp2_torch-zero0"),
      pytest.param("fsdp2_torch", Ours(2), marks=[_in_axes(Ours(2)), SLOW], id="fsdp2_torch-zero2"),
      pytest.param("fsdp2_torch", Ours(3, "optim"), marks=[_in_axes(Ours(3, "optim")), SLOW],
                   id="fsdp2_torch-zero3-hsdp_optim"),
      pytest.param("fsdp2_titan", Ours(3), marks=[_in_axes(Ours(3)), SLOW], id="fsdp2_titan-zero3"),
      pytest.param("fsdp2_titan", Ours(1), marks=[_in_axes(Ours(1)), SLOW], id="fsdp2_titan-zero1")]


@pytest.mark.parametrize("layout,config", IN)
def test_fsdp2_checkpoint_continues_in_ours_like_in_fsdp2(layout: str, config: Ours, dist_env: Any,
                                                          session_shared_tmp_path: Path) -> None:
    path = produced(session_shared_tmp_path) / layout
    expected_losses, expected = fsdp2_continuation(path, layout)
    losses, final = our_continuation(path, config, TITAN_EXTRA if layout == "fsdp2_titan" else {})
    assert losses == expected_losses, f"ours {losses} != FSDP2 {expected_losses}"
    assert_same_state(final, expected, None, f"after {N_AFTER} steps, ours ({config}) vs FSDP2")


OUT = [pytest.param("ours_zero3", Ours(3), marks=[pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params")],
                    id="ours_zero3-to-zero3"),
       pytest.param("ours_hsdp", Ours(1), marks=[pytest.mark.matrix(mesh=axes.mesh(2), zero="optim"), SLOW],
                    id="ours_hsdp-to-zero1")]


@pytest.mark.parametrize("saved,config", OUT)
def test_our_checkpoint_continues_in_fsdp2_like_in_ours(saved: str, config: Ours, dist_env: Any,
                                                        session_shared_tmp_path: Path) -> None:
    """``saved``: ours at world 4 (ZeRO-3, or HSDP 2x2), ``format="torch_dcp"``; ``config``: the
    world-2 run of ours that is the reference."""
    path = produced(session_shared_tmp_path) / saved
    expected_losses, expected = our_continuation(path, config, {"step": K_SAVE})
    losses, final = fsdp2_continuation(path, "fsdp2_torch")
    assert losses == expected_losses, f"FSDP2 {losses} != ours {expected_losses}"
    assert_same_state(final, expected, None, f"after {N_AFTER} steps, FSDP2 vs ours ({config})")
