"""Megatron-FSDP's ``test_fully_shard`` matrix (the "seed" test), ported with numbers checked.

model {CNN, Transformer, TE Transformer} x dp_shard strategy {0..3} x dp_outer {None, no_shard,
optim} x mesh (dp_outer, dp_shard, cp, tp) {(2,2,2,1), (1,2,2,2), (2,2,1,2)} x {fp32 main params
+ meta init + torch.compile, no main params + eager init}, on 8 ranks, with the seed's skip rules
(meta init with no_shard; outer optim with inner != optim_grads_params; TE when it is missing).

Beyond the seed's "grads exist only after the sync microbatch" check, every case trains 3
optimisation steps of 2 microbatches (no sync, then sync) with the seed's Adam(lr=0.01) and
compares with a single-process reference that starts from the wrapped model's initial full params
and sees the union of the samples of the ranks that average grads together:
- each microbatch's loss on this rank vs the reference's loss on the same sample (rtol 1e-5 on
  step 0, 1e-4 later);
- the synced grads vs the reference's accumulated grads (per tensor, rtol 1e-5 on step 0, where
  params are bit-identical: this is what catches a wrong average, which Adam's scale invariance
  would hide; later steps whole-model 1e-2, see LATER_GRAD_RTOL);
- the params after every step (per tensor rtol 1e-4 after step 0; whole-model 1e-3 later);
- the initial params are identical on all 8 ranks (replicas over dp_outer/tp/cp agree).
Measured (CPU, torch 2.13): loss errors <= 1e-5, step-0 grad and param errors <= ~1e-7; later
grad errors up to 2.2e-3 (meta-init Transformer only, see LATER_GRAD_RTOL).

Deviations from the seed, all for determinism or CPU speed: the toy Transformer has dropout 0
(random dropout masks differ per rank, so parity would be meaningless); inputs are seeded per
(step, microbatch, sample) instead of unseeded ``torch.randn``; on CPU, compile uses the
``eager`` Dynamo backend by default (``FSDP_MATRIX_CPU_COMPILE_BACKEND=aot_eager`` for AOTAutograd
too; inductor compiles C++ per graph and per rank, too slow with 8 ranks on 2 cores) and
``inductor`` on CUDA.

CPU cost (the budget: under 15 min on 2 cores). The whole matrix is one 8-rank bucket, so start-up is
paid once: runnable cases come first and skipped ones last, because the harness restarts a bucket
whenever the next item is skip-marked. Per rank process, meshes are cached (common/mesh.py), the
single-process reference run is cached per (model, data group size, bit-identical initial params)
since it does not depend on the strategy or mesh (9 runs instead of 96), and Dynamo's cache is
kept across cases (no ``torch._dynamo.reset()``): later cases reuse the graphs (5 compiles per rank
in all), a counting backend asserts that compiled graphs ran in every compiled case, and hitting
the recompile limit raises instead of silently running eager.
Measured 2026-11-30 (torch 2.13 CPU, shared 2-core box, load average 18-51): 96 passed, 120
skipped; wall 3 min 51 s, 426 CPU-seconds (user 364 + sys 62; ~3.6 min on a quiet 2-core box).
So every cell but ``FAST_CELL`` is marked slow: the L0/L1 tiers run one 8-rank cell, L2 all.
"""
from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.functional import mse_loss

from fsdp_impl import MixedPrecisionPolicy, fully_shard
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.mesh import (
    assert_same_on_all_ranks,
    data_group,
    data_position,
    gathered_full_params,
    seed_kwargs,
    seed_mesh,
    sharded_max_error,
    sharded_model_error,
)
from tests.functional.common.models import TOY_MODELS, TOY_SIZE, build_toy, run_toy

try:
    import transformer_engine as te  # noqa: F401

    HAVE_TE = True
except ImportError:  # pragma: no cover - depends on the machine
    HAVE_TE = False

pytestmark = [
    pytest.mark.distributed(world_size=8, timeout=600, bucket="fully_shard_matrix"),
    pytest.mark.matrix(dtype="fp32"),
]

STEPS, MICRO = 3, 2
LOSS_RTOL, GRAD_RTOL, PARAM_RTOL = 1e-5, 1e-5, 1e-4
# After step 0: the seed's d_model=2 LayerNorms normalise 2 elements, so grads react ~1e4x to
# parameter differences (measured: 6e-8 param error -> 8.7e-4 grad error -> 1.7e-2 error in a
# near-zero LayerNorm bias after Adam; meta-init Transformer, with or without compile). Later
# steps are therefore checked as whole-model errors (all params together) at these tolerances.
LATER_GRAD_RTOL, LATER_PARAM_RTOL, LATER_LOSS_RTOL = 1e-2, 1e-3, 1e-4
MODELS = ("cnn", "transformer", "te_transformer")
STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
OUTERS = (None, "no_shard", "optim")
MESHES = ((2, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 2))
# CPU default "eager": Dynamo traces the wrapped model (graph breaks at our compiler-disabled
# hooks) without AOTAutograd; about 2x cheaper than "aot_eager" (measured 14 s vs 28 s per case on
# a loaded 2-core box), which is what keeps the 8-rank matrix within budget.
# FSDP_MATRIX_CPU_COMPILE_BACKEND=aot_eager also traces the backward through AOTAutograd.
CPU_COMPILE_BACKEND = os.environ.get("FSDP_MATRIX_CPU_COMPILE_BACKEND", "eager")
COMMON = ({"fp32_main": True, "meta": True, "compile": True},
          {"fp32_main": False, "meta": False, "compile": False})
# The one cell the fast tiers run (every other cell is marked slow): HFSDP with ZeRO-3 on the
# mesh with cp=2, eager (compile is covered on 4 ranks by test_engine_seed_compat.py).
FAST_CELL = "cnn-optim_grads_params-outer_optim-mesh2221-eager"


def _samples(step: int, micro: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The ``n`` (input, target) pairs of one microbatch, identical on every rank."""
    gen = torch.Generator().manual_seed(10_000 + 100 * step + micro)
    return [(torch.randn(1, TOY_SIZE, TOY_SIZE, generator=gen), torch.randn(1, TOY_SIZE, TOY_SIZE, generator=gen))
            for _ in range(n)]


def _skip_reason(model_type: str, strategy: str, outer: str | None, common: dict) -> str | None:
    if model_type == "te_transformer":
        return None if HAVE_TE else "TransformerEngine is not installed (te_transformer needs it)"
    if common["meta"] and strategy == "no_shard":
        return "meta-device init is not supported or needed for the 'no_shard'/0 strategy (seed rule)"
    if outer == "optim" and strategy != "optim_grads_params":
        return "dp_outer 'optim' requires zero_dp_strategy 'optim_grads_params'/3 (seed rule)"
    return None


def _cases() -> list:
    cases = []
    for model_type, strategy, outer, mesh, common in itertools.product(MODELS, STRATEGIES, OUTERS, MESHES, COMMON):
        cid = (f"{model_type}-{strategy}-outer_{outer}-mesh{''.join(map(str, mesh))}-"
               f"{'fp32main_meta_compile' if common['compile'] else 'eager'}")
        reason = _skip_reason(model_type, strategy, outer, common)
        if model_type == "te_transformer" and reason is None:
            reason = "te_transformer needs CUDA and the GPU suite (TE modules do not run on CPU)"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        if cid != FAST_CELL:
            marks.append(pytest.mark.slow)
        cases.append(pytest.param(model_type, strategy, outer, mesh, common, id=cid, marks=marks))
    # Runnable cases first, skipped ones last (stable sort): the harness tears a bucket down when
    # the next item is skip-marked (harness/spawn/controller.py ``same_next``), so interleaved skips
    # restarted the 8 ranks (imports, process groups, meshes, Dynamo caches) ~30 times.
    return sorted(cases, key=lambda case: any(m.name == "skip" for m in case.marks))


class _Reference:
    """Single-process copy trained on the union of the data group's samples."""

    def __init__(self, model_type: str, initial: dict[str, torch.Tensor]) -> None:
        self.model_type = model_type
        self.model, _ = build_toy(model_type)
        self.model.load_state_dict(initial, strict=True)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=0.01)

    def microbatch(self, samples: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
        """Accumulate the grad of the sample-mean loss; return each sample's loss."""
        losses = [mse_loss(run_toy(self.model, self.model_type, x), y) for x, y in samples]
        torch.stack(losses).mean().backward()
        return [loss.item() for loss in losses]

    def grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}

    def step(self) -> dict[str, torch.Tensor]:
        self.opt.step()
        self.opt.zero_grad()
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


@dataclass
class _Expected:
    """The reference's whole run: each microbatch's per-sample losses (index ``step * MICRO +
    micro``), and each step's accumulated grads and updated params."""

    losses: list[list[float]]
    grads: list[dict[str, torch.Tensor]]
    params: list[dict[str, torch.Tensor]]


# (model_type, samples per microbatch) -> [(initial params, run)], per rank process.
_EXPECTED: dict[tuple[str, int], list[tuple[dict[str, torch.Tensor], _Expected]]] = {}


def _train_reference(model_type: str, initial: dict[str, torch.Tensor], n: int) -> _Expected:
    ref = _Reference(model_type, initial)
    losses, grads, params = [], [], []
    for step in range(STEPS):
        for micro in range(MICRO):
            losses.append(ref.microbatch(_samples(step, micro, n)))
        grads.append(ref.grads())
        params.append(ref.step())
    return _Expected(losses, grads, params)


def _expected(model_type: str, initial: dict[str, torch.Tensor], n: int) -> _Expected:
    """The reference run, cached: it depends only on the model, its exact initial params and the
    data group size (not on the strategy, outer strategy or mesh), so the 96 cases need only a
    handful of distinct runs; the initial params are compared bit for bit before reuse."""
    runs = _EXPECTED.setdefault((model_type, n), [])
    for start, run in runs:
        if start.keys() == initial.keys() and all(torch.equal(start[k], initial[k]) for k in start):
            return run
    run = _train_reference(model_type, initial, n)
    runs.append(({k: v.clone() for k, v in initial.items()}, run))
    return run


class _CountingBackend:
    """Dynamo backend around ``name`` that counts compiles and calls of the compiled graphs, so a
    compiled case can prove that compiled code ran (no silent fallback to eager). One instance per
    backend name for the whole process: Dynamo guards on the backend's identity, so a fresh one per
    case would recompile every frame."""

    def __init__(self, name: str) -> None:
        self.inner = torch._dynamo.lookup_backend(name)
        self.compiles, self.calls = 0, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable[..., Any]:
        self.compiles += 1
        fn = self.inner(gm, example_inputs)
        boxed = getattr(fn, "_boxed_call", False)

        def run(*args: Any) -> Any:
            self.calls += 1
            return fn(*args)

        run._boxed_call = boxed  # type: ignore[attr-defined]
        return run


def _old_dynamo() -> bool:
    """torch < 2.13 (the GPU machine's 2.11). There Dynamo skips a whole frame that graph-breaks
    inside a loop ("graph breaks in loops are not supported"), and every FSDP unit's hooks are
    compiler-disabled calls made from the hook loop of ``nn.Module._call_impl``: on 2.11 neither
    ``torch.compile(model)`` nor ``unit.compile()`` ran any compiled graph (measured: 0 backend
    calls in all 42 compiled cases). So on old Dynamo each unit's ``forward`` is compiled on its
    own (the hooks stay eager around it, as with FSDP2's per-block compile) and each compiled case
    starts from a clean Dynamo. FSDP_MATRIX_OLD_DYNAMO=1/0 forces either path."""
    forced = os.environ.get("FSDP_MATRIX_OLD_DYNAMO")
    if forced in ("0", "1"):
        return forced == "1"
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    return (major, minor) < (2, 13)


def _compiled(model: nn.Module, model_type: str, backend: Any) -> nn.Module:
    """What the case runs: the whole compiled model (the seed's way), or on old Dynamo the
    model with each unit module's ``forward`` compiled (hooks outside the compiled code)."""
    if not _old_dynamo():
        return torch.compile(model, backend=backend)
    units = tuple(TOY_MODELS[model_type][1])
    for sub in model.module.modules():
        if isinstance(sub, units):
            sub.forward = torch.compile(type(sub).forward.__get__(sub), backend=backend)
    return model


@functools.cache
def _backend(name: str) -> _CountingBackend:
    return _CountingBackend(name)


def _wrap(model_type: str, strategy: str, outer: str | None, mesh_shape: tuple, common: dict, device):
    mesh = seed_mesh(mesh_shape, device.type)
    module, units = build_toy(model_type, "meta" if common["meta"] else "cpu")
    if not common["meta"]:
        module = module.to(device)
    model, opt = fully_shard(
        module, torch.optim.Adam(module.parameters(), lr=0.01), fsdp_unit_modules=units,
        zero_dp_strategy=strategy, init_model_with_meta_device=common["meta"], report_nan_in_param_grad=True,
        mixed_precision_policy=MixedPrecisionPolicy(
            main_params_dtype=torch.float32 if common["fp32_main"] else None, main_grads_dtype=None),
        **seed_kwargs(mesh, outer))
    return mesh, model, opt


def _check_grads(model: nn.Module, expected: dict[str, torch.Tensor], step: int, param_err: float) -> None:
    if step == 0:
        err, where = sharded_max_error(model, expected, grads=True)
    else:
        err, where = sharded_model_error(model, expected, grads=True), "<whole model>"
    assert err <= (GRAD_RTOL if step == 0 else LATER_GRAD_RTOL), \
        f"step {step}: grad {where} relative error {err:.3g} (param error before it: {param_err:.3g})"


def _check_params(model: nn.Module, expected: dict[str, torch.Tensor], step: int) -> float:
    if step == 0:
        err, where = sharded_max_error(model, expected)
    else:
        err, where = sharded_model_error(model, expected), "<whole model>"
    assert err <= (PARAM_RTOL if step == 0 else LATER_PARAM_RTOL), \
        f"step {step}: param {where} relative error {err:.3g}"
    return err


def _train_and_check(model: nn.Module, runner: nn.Module, opt: torch.optim.Optimizer, model_type: str,
                     expected: _Expected, pos: int, n: int, device: torch.device) -> None:
    """3 steps of (no-sync, sync) microbatches; losses, synced grads and params vs the reference."""
    param_err = 0.0  # previous step's parameter error, reported with a grad mismatch
    for step in range(STEPS):
        for micro in range(MICRO):
            sync = micro == MICRO - 1
            runner.set_model_auto_sync(sync)
            x, y = (t.to(device) for t in _samples(step, micro, n)[pos])
            loss = mse_loss(run_toy(runner, model_type, x), y)
            loss.backward()
            ref_loss = expected.losses[step * MICRO + micro][pos]
            rtol = LOSS_RTOL if step == 0 else LATER_LOSS_RTOL
            assert abs(loss.item() - ref_loss) <= rtol * max(abs(ref_loss), 1e-6), \
                f"step {step} microbatch {micro}: loss {loss.item()} vs reference {ref_loss}"
            if not sync:
                held = [name for name, p in model.module.named_parameters() if p.grad is not None]
                assert not held, f"grads exist before the sync microbatch: {held}"
        _check_grads(model, expected.grads[step], step, param_err)
        opt.step()
        opt.zero_grad()
        param_err = _check_params(model, expected.params[step], step)


@pytest.mark.parametrize("model_type,strategy,outer,mesh_shape,common", _cases())
@pytest.mark.matrix(mesh=matrix.param("mesh_shape", axes.mesh_shape), zero=matrix.param("strategy", axes.zero),
                    outer=matrix.param("outer", axes.outer), model=matrix.param("model_type"),
                    graph=matrix.param("common", lambda c: "compile" if c["compile"] else "eager"))
def test_fully_shard(model_type: str, strategy: str, outer: str | None, mesh_shape: tuple, common: dict,
                     dist_env) -> None:
    mesh, model, opt = _wrap(model_type, strategy, outer, mesh_shape, common, dist_env.device)
    initial = gathered_full_params(model)
    assert_same_on_all_ranks(initial, "initial params")
    pos, n = data_position(data_group(mesh, outer))
    expected = _expected(model_type, initial, n)
    runner, backend = model, None
    if common["compile"] and os.environ.get("FSDP_MATRIX_COMPILE", "1") != "0":  # 0: debugging aid
        # No torch._dynamo.reset() between cases: the cases share code objects and (with
        # inline_inbuilt_nn_modules) guards, so later cases reuse the graphs; hitting the
        # recompile limit raises instead of silently falling back to eager.
        if _old_dynamo():
            torch._dynamo.reset()
        backend = _backend("inductor" if dist_env.device.type == "cuda" else CPU_COMPILE_BACKEND)
        runner = _compiled(model, model_type, backend)
    calls = backend.calls if backend else 0
    # recompile_limit 64 (default 8): the cases share code objects, and each new model/mesh may
    # add guard entries (torch 2.11 adds more than 2.13); the limit only bounds cache growth, and
    # reaching it still raises rather than running eager.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=64):
        _train_and_check(model, runner, opt, model_type, expected, pos, n, dist_env.device)
    if backend is not None:
        assert backend.calls > calls, "torch.compile ran no compiled graph (fell back to eager)"
    dist.barrier()
