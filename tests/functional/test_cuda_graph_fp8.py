"""CUDA-graph replay of FP8-parameter training equals eager, bit for bit (GPU only; on CPU every
case skips naming CUDA, TE cases also name TransformerEngine).

FP8 parameters under ``cuda_graph_mode=True``: the captured step holds the sharded
requantisation (partial amaxes, the MAX all-reduce, the casts into the local FP8 bytes), the
FP8-byte gathers and the FP8 GEMMs, so a replay runs the whole FP8 step without the host.

Each case builds the same model twice from one seed, both with ``cuda_graph_mode=True`` and
``fsdp_impl.optim.AdamW(capturable=True, fused=True)``:

- eager: WARMUP steps on the warm-up batch (what ``capture_train_step`` runs before capturing),
  then STEPS steps of ``zero_grad(set_to_none=False)``, forward+loss+backward and ``step()`` on a
  new batch each step;
- replay: ``capture_train_step(..., warmup=WARMUP)``, then STEPS replays on the same batches.

Checked: per-step losses and every fp32 main param after STEPS steps are ``torch.equal`` (the
same kernels on the same data), the losses change from step to step (new data and new FP8 bytes
reach the graph), and EXTRA more replays leave ``torch.cuda.memory_allocated()`` unchanged.

Models: torch-native ``Float8Linear`` (``tests.functional.common.fp8_training``: two MLP blocks
and a head; recipes current, delayed, blockwise) and TransformerEngine ``LayerNormMLP`` units
built under ``te.quantized_model_init`` (``test_fp8_te``; recipes current, delayed and block).
ZeRO-3 with and without ``keep_fp8_transpose_cache``, and ZeRO-2; 1 GPU, and 2 GPUs (uneven
shards, the amax all-reduce across ranks inside the graph). Measured on H200s (TE 2.20.2, torch
2.11): all world-1 and world-2 cases pass. The h200 L0 tier runs the TE world-2 cell.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_impl import MixedPrecisionPolicy, fully_shard
from fsdp_impl.cuda_graph import capture_train_step
from fsdp_impl.optim import AdamW
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common import fp8_training as native
from tests.functional.common.graph_training import assert_params_equal, full_params, warmup_then_steps

pytestmark = [pytest.mark.requires_cuda, pytest.mark.matrix(dtype="bf16", graph="cuda_graph")]

WARMUP, STEPS, EXTRA = 3, 6, 5


@dataclass(frozen=True)
class Fp8GraphCase:
    path: str  # "native" (fsdp_impl.fp8) or "te"
    recipe: str
    strategy: int = 3
    keep_transpose: bool = True

    @property
    def id(self) -> str:
        keep = "-keep" if self.keep_transpose else ""
        return f"{self.path}-{self.recipe}-zero{self.strategy}{keep}"


CASES = [Fp8GraphCase("native", r) for r in ("current", "delayed", "blockwise")] + [
    Fp8GraphCase("native", "current", 3, False), Fp8GraphCase("native", "current", 2, False),
    Fp8GraphCase("te", "current"), Fp8GraphCase("te", "current", 3, False), Fp8GraphCase("te", "current", 2, False),
    Fp8GraphCase("te", "block"), Fp8GraphCase("te", "delayed"),
]


def _ids(case: Fp8GraphCase) -> str:
    return case.id


def _cell(world: int) -> pytest.MarkDecorator:
    return pytest.mark.matrix(mesh=axes.mesh(world), zero=axes.item("case", "strategy", axes.zero),
                              model=matrix.param("case", lambda c: "fp8_net" if c.path == "native" else "te_net"),
                              recipe=axes.item("case", "recipe", axes.recipe))


def _te_recipe(name: str) -> Any:
    pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
    from tests.functional.common.te_fp8 import te_recipe
    return te_recipe(name)


def _build(case: Fp8GraphCase, device: torch.device) -> tuple[nn.Module, Callable[[], Any]]:
    """The FP8-parameter model of seed 0 on ``device`` and the autocast context of its forward."""
    if case.path == "native":
        return native.build(case.recipe), contextlib.nullcontext
    import transformer_engine.pytorch as te

    from tests.functional.common.te_fp8 import build_te
    recipe = _te_recipe(case.recipe)
    return build_te(recipe, fp8_params=True), lambda: te.autocast(recipe=recipe)


def _units(case: Fp8GraphCase) -> list[type]:
    if case.path == "native":
        return [native.Fp8Block]
    from tests.functional.common.te_fp8 import unit_classes
    return unit_classes()


def _batch(case: Fp8GraphCase, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    slot = dist.get_rank()
    if case.path == "native":
        x, y = native.batch(step, slot, 0)
        return x.to(device), y.to(device)
    from tests.functional.common.te_fp8 import te_batch
    return te_batch(step, slot)


def wrap(case: Fp8GraphCase, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer, Callable]:
    """Model, optimizer and ``step_fn(x, y)`` (forward under the recipe, loss, backward)."""
    module, autocast = _build(case, device)
    opt = AdamW(module.parameters(), lr=1e-2, weight_decay=0.01, capturable=True, fused=True)
    model, opt = fully_shard(module, opt, fsdp_unit_modules=_units(case), zero_dp_strategy=case.strategy,
                             mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32),
                             keep_fp8_transpose_cache=case.keep_transpose, cuda_graph_mode=True)
    assert any(u.fp8 is not None for u in model._fsdp_engine.units), "no FP8 parameters were found"

    def step_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with autocast():
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        return loss
    return model, opt, step_fn


def _eager(case: Fp8GraphCase, device: torch.device) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model, opt, step_fn = wrap(case, device)
    losses = warmup_then_steps(opt, step_fn, _batch(case, 0, device), WARMUP,
                               [_batch(case, k + 1, device) for k in range(STEPS)])
    return losses, full_params(model)


def _replay(case: Fp8GraphCase, device: torch.device) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model, opt, step_fn = wrap(case, device)
    static = tuple(t.clone() for t in _batch(case, 0, device))
    captured = capture_train_step(model, opt, step_fn, static, warmup=WARMUP)
    losses = []
    for k in range(STEPS):
        captured.copy_inputs(*_batch(case, k + 1, device))
        losses.append(captured.replay().detach().clone())
    params = full_params(model)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    for k in range(EXTRA):
        captured.copy_inputs(*_batch(case, 100 + k, device))
        captured.replay()
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) == before, "FP8 replays leaked memory"
    return losses, params


def check_fp8_replay_matches_eager(case: Fp8GraphCase, device: torch.device) -> None:
    if case.path == "native" and torch.cuda.get_device_capability(device) < (8, 9):
        pytest.skip("FP8 GEMMs (torch._scaled_mm) need sm_89 or newer")
    ref_losses, ref_params = _eager(case, device)
    losses, params = _replay(case, device)
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert torch.equal(a, b), f"step {k}: replay loss {a.item()!r} != eager {b.item()!r}"
    assert len({float(x) for x in losses}) == len(losses), f"losses repeat: {[float(x) for x in losses]}"
    assert_params_equal(params, ref_params, "replay vs eager (fp32 main params)")


@pytest.mark.distributed(world_size=1, timeout=600)
@_cell(1)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fp8_replay_matches_eager_world1(case: Fp8GraphCase, dist_env) -> None:
    check_fp8_replay_matches_eager(case, dist_env.device)


@pytest.mark.distributed(world_size=2, timeout=600)
@_cell(2)
@pytest.mark.parametrize("case", [Fp8GraphCase("native", "current"), Fp8GraphCase("native", "blockwise"),
                                  Fp8GraphCase("te", "current"), Fp8GraphCase("te", "current", 2, False)],
                         ids=_ids)
def test_fp8_replay_matches_eager_world2(case: Fp8GraphCase, dist_env) -> None:
    """Uneven shards (3-row head) and the amax MAX all-reduce across 2 ranks inside the graph."""
    check_fp8_replay_matches_eager(case, dist_env.device)
