"""Exact resume through ``fsdp_impl.checkpoint``, on the same and on another world size.

Every test is self-sufficient: it produces the checkpoint it loads, so no test waits for another
test, bucket or xdist worker, and any ``-k`` selection runs.

Same world size: one test trains ``N_STEPS`` steps uninterrupted, saving after ``K_SAVE`` steps,
and records the per-step losses plus the full parameters and Adam state at the save and at the
end. It then wraps a freshly initialised model (other seed) with a never-stepped optimizer built
with another learning rate, runs an evaluation forward (so the engine holds compute weights
from the random init), loads the checkpoint and checks:

- right after ``load``: parameters, Adam ``exp_avg``/``exp_avg_sq`` and ``step`` (== K_SAVE, so no
  dummy step ran) equal the recorded ones bit for bit, and the param groups' learning rates are
  the saved ones;
- training on: every loss, the final parameters and the final Adam state equal the
  uninterrupted run's bit for bit (CPU fp32: the same arithmetic in the same order). Stale
  compute weights from the random init would change the first loss by > 1e-2.

Another world size: the checkpoint comes from ``save_in_spawned_world`` (fresh gloo processes
of the other world size, started by rank 0 once per bucket for all the cases it needs). Right
after the load the state equals the saved one bit for bit (a cross-size load is a pure copy);
the continuation is compared with a single-process reference that starts from the saved state
(params, moments, step counts) and trains on the full batches, at ``CROSS_RTOL`` = 1e-5 on losses
and per tensor: the reduction order differs (other ranks per reduction, all-reduce vs
reduce-scatter), which changes fp32 results by a few ulp per step. A step count off by one
changes Adam's bias correction and the parameters by ~1e-3 relative.
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
from tests.functional.common.checkpointing import (
    GLOBAL_BATCH,
    K_SAVE,
    LR,
    N_STEPS,
    RECORD,
    Case,
    assert_same_state,
    case_dir,
    full_state,
    learning_rates,
    probe_forward,
    save_in_spawned_world,
    train_step,
    train_with_checkpoint,
    wrap,
)
from tests.functional.common.models import build_model, loss_fn, make_batch
from tests.functional.common.numerics import assert_losses_close
from tests.functional.common.reference import make_optimizer

RESUME_LR = 0.5  # a fresh optimizer with the wrong lr: the load must restore the saved one
CROSS_RTOL = 1e-5
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MODELS = ("cnn", "transformer")


def _matrix() -> list[Case]:
    """strategy {0..3} x outer {None, no_shard, optim where allowed (inner 3)} x model."""
    cases = []
    for model in MODELS:
        for strategy in STRATEGIES:
            for outer in (None, "no_shard", "optim"):
                if outer == "optim" and strategy != "optim_grads_params":
                    continue  # not a valid configuration (the engine rejects it at wrap time)
                cases.append(Case(model, strategy, outer))
    return cases


MATRIX = _matrix()
SAME_ON_2 = [Case("cnn", "optim_grads_params"), Case("transformer", "optim")]
CROSS_4_TO_2 = [  # (saved on 4 ranks, loaded on 2 ranks): other world size *and* strategy
    (Case("cnn", "optim_grads_params"), Case("cnn", "optim")),
    (Case("transformer", "optim_grads_params"), Case("transformer", "optim")),
    (Case("cnn", "no_shard"), Case("cnn", "optim_grads_params")),
    (Case("transformer", "optim_grads"), Case("transformer", "no_shard")),
    (Case("cnn", "optim_grads_params", "optim"), Case("cnn", "optim_grads")),  # HFSDP 2x2 -> FSDP
    (Case("transformer", "optim", "no_shard"), Case("transformer", "optim_grads_params")),  # HSDP -> FSDP
]
CROSS_2_TO_4 = [  # (saved on 2 ranks, loaded on 4 ranks)
    (Case("cnn", "optim_grads_params"), Case("cnn", "optim_grads")),
    (Case("transformer", "optim"), Case("transformer", "optim_grads_params")),
    (Case("cnn", "optim_grads_params"), Case("cnn", "optim_grads_params", "optim")),  # FSDP -> HFSDP 2x2
]


def resume(loaded: Case, path: Path, record: dict[str, Any], dist_env: Any) -> tuple[list[float], dict]:
    """Load ``path`` into a fresh ``loaded`` wrap, check the state right after the load against
    ``record``, train to the end; return the resumed losses and the final state."""
    model, optimizer = wrap(loaded, dist_env.device, seed=1234, lr=RESUME_LR)
    probe_forward(model, loaded.model, dist_env.device)  # compute weights now hold the random init
    assert len(optimizer.state) == 0, "the optimizer must not have stepped before the load"
    extra = checkpoint.load(path, model, optimizer)

    assert extra["next_step"] == K_SAVE and extra["losses"] == record["losses"][:K_SAVE]
    assert learning_rates(optimizer) == record["lr"], "param-group hyperparameters not restored"
    after_load = full_state(model, optimizer)
    assert_same_state(after_load, record["at_save"], None, "right after load")
    steps = {float(v) for k, v in after_load.items() if k.endswith(":step")}
    assert steps == {float(K_SAVE)}, f"Adam step counts after load: {steps}"
    losses = [train_step(model, optimizer, loaded.model, s, dist_env.device) for s in range(K_SAVE, N_STEPS)]
    return losses, full_state(model, optimizer)


def check_same_world(case: Case, dist_env: Any, root: Path) -> None:
    model, optimizer = wrap(case, dist_env.device, seed=0)
    record = train_with_checkpoint(case, model, optimizer, dist_env.device, root / "ckpt")
    del model, optimizer
    losses, final = resume(case, root / "ckpt", record, dist_env)
    expected = record["losses"][K_SAVE:]
    assert losses == expected, f"resumed losses {losses} != uninterrupted {expected}"
    assert_same_state(final, record["final"], None, "after resumed training")


def reference_continuation(model_name: str, at_save: dict[str, torch.Tensor], device: torch.device
                           ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A single-process model and two-group Adam set to the saved state (``full_state`` names of
    the wrapped model, ``module.`` + the plain name), trained on the full batches of steps
    ``K_SAVE``..``N_STEPS - 1``; returns the losses and the final state under the same names."""
    model = build_model(model_name).to(device)
    optimizer = make_optimizer("adam", model.named_parameters(), lr=LR)
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = f"module.{name}"
            p.copy_(at_save[key])
            optimizer.state[p] = {"step": at_save[f"{key}:step"].clone(),
                                  "exp_avg": at_save[f"{key}:exp_avg"].to(device),
                                  "exp_avg_sq": at_save[f"{key}:exp_avg_sq"].to(device)}
    losses = []
    for step in range(K_SAVE, N_STEPS):
        inputs, target = make_batch(model_name, GLOBAL_BATCH, seed=1000 + step)
        loss = loss_fn(model_name)(model(*[x.to(device) for x in inputs]), target.to(device))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    final: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        key, state = f"module.{name}", optimizer.state[p]
        final[key] = p.detach().cpu().clone()
        final[f"{key}:exp_avg"] = state["exp_avg"].cpu().clone()
        final[f"{key}:exp_avg_sq"] = state["exp_avg_sq"].cpu().clone()
        final[f"{key}:step"] = torch.as_tensor(state["step"]).cpu().clone()
    return losses, final


_SAVED_ELSEWHERE: dict[int, Path] = {}  # world size -> directory of its checkpoints (per rank process)


def saved_on(world: int, cases: list[Case], session_dir: Path) -> Path:
    """The directory with ``cases`` saved on ``world`` spawned ranks, produced on the first call
    in this bucket (rank 0 runs them; every rank gets the same path or the same error)."""
    if world not in _SAVED_ELSEWHERE:
        outcome: list[Any] = [f"ckpt-from-ws{world}-{uuid.uuid4().hex[:12]}", None]
        if dist.get_rank() == 0:
            try:
                save_in_spawned_world(world, cases, session_dir / outcome[0])
            except Exception as exc:  # reported on every rank below, so all ranks fail alike
                outcome[1] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(outcome, src=0)
        if outcome[1] is not None:
            raise RuntimeError(f"saving {len(cases)} checkpoint(s) on {world} spawned ranks failed: {outcome[1]}")
        _SAVED_ELSEWHERE[world] = session_dir / outcome[0]
    return _SAVED_ELSEWHERE[world]


def check_cross_world(saved: Case, saved_world: int, all_saved: list[Case], loaded: Case, dist_env: Any,
                      session_dir: Path) -> None:
    target = case_dir(saved_on(saved_world, all_saved, session_dir), saved)
    record = torch.load(target / RECORD, weights_only=False)
    losses, final = resume(loaded, target / "ckpt", record, dist_env)
    ref_losses, ref_final = reference_continuation(loaded.model, record["at_save"], dist_env.device)
    assert_losses_close(losses, ref_losses, CROSS_RTOL, "resumed losses vs the reference continuation")
    assert_same_state(final, ref_final, CROSS_RTOL, "after resumed training vs the reference continuation")


def _in_bucket(world: int, timeout: float) -> pytest.MarkDecorator:
    return pytest.mark.distributed(world_size=world, bucket=f"ckpt-ws{world}", timeout=timeout)


def _case_axes(world: int, param: str = "case") -> pytest.MarkDecorator:
    """The matrix cell of the Case ``param`` trained on ``world`` ranks (an HSDP case on a (2, world/2) mesh)."""
    def mesh(outer: str | None) -> str:
        return axes.mesh(world) if outer is None else axes.mesh(world // 2, outer=2)
    return pytest.mark.matrix(mesh=axes.item(param, "outer", mesh), zero=axes.item(param, "strategy"),
                              outer=axes.item(param, "outer"), model=axes.item(param, "model"), dtype="fp32")


SAME_WORLD = ([pytest.param(c, marks=[_in_bucket(4, 300), _case_axes(4)], id=f"ws4-{c}") for c in MATRIX]
              + [pytest.param(c, marks=[_in_bucket(2, 300), _case_axes(2)], id=f"ws2-{c}") for c in SAME_ON_2])
CROSS = {2: (4, CROSS_2_TO_4), 4: (2, CROSS_4_TO_2)}  # saved on -> (loaded on, (saved, loaded) pairs)
OTHER_WORLD = [pytest.param(saved, saved_on, loaded,
                            marks=[_in_bucket(loaded_on, 600), _case_axes(loaded_on, "loaded")],
                            id=f"ws{saved_on}to{loaded_on}-{saved}-to-{loaded}")
               for saved_on, (loaded_on, pairs) in CROSS.items() for saved, loaded in pairs]


@pytest.mark.parametrize("case", SAME_WORLD)
def test_resume_is_bit_exact(case: Case, dist_env: Any, shared_tmp_path: Path) -> None:
    check_same_world(case, dist_env, shared_tmp_path)


@pytest.mark.parametrize("saved,saved_world,loaded", OTHER_WORLD)
def test_resume_checkpoint_of_another_world_size(saved: Case, saved_world: int, loaded: Case, dist_env: Any,
                                                 session_shared_tmp_path: Path) -> None:
    all_saved = sorted({s for s, _ in CROSS[saved_world][1]}, key=str)
    check_cross_world(saved, saved_world, all_saved, loaded, dist_env, session_shared_tmp_path)
