"""Activation recompute inside and around FSDP units, on every ZeRO level and unshard storage.

Recompute does not change the math: a recomputed forward runs the same kernels on the same
values, so losses, every step's synced grads and the trained params must be **bit-identical**
to the same model trained without recompute (``common/recompute.py`` lists the styles). The
failure this suite was written for: a recompute inside a unit's forward read the unit's sharded
DTensor params (``aten.native_layer_norm.default got mixed torch.Tensor and DTensor``), and a
ZeRO-3 recompute could read freed or re-used compute storage (silently wrong grads).

Collective counts: ZeRO-3's pre-backward gather of a unit serves its recompute too (the
recompute runs inside the unit's backward, or, for a region of several units, the region's
earlier units are gathered for the recompute and kept for their own backward), so a step with
recompute issues exactly the all-gathers of a step without: 2 per non-root unit + 1 for the root.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

import fsdp_impl
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common import fp8_training
from tests.functional.common.collective_counter import CollectiveCounter
from tests.functional.common.mesh import seed_kwargs, seed_mesh
from tests.functional.common.recompute import (
    RecomputeBlock,
    RunRecord,
    assert_bit_identical,
    build_net,
    train,
    wrap_blocks,
)

pytestmark = pytest.mark.matrix(model="recompute_mlp", dtype="fp32", graph="eager")

STYLES = ["inside", "inside_reentrant", "wrapper", "selective"]
MORE_STYLES = ["wrapper_reentrant", "wrapper_after", "region"]
# (ZeRO strategy, unshard storage): storage only matters for ZeRO-3 (ZeRO-0/1/2 compute params persist)
CASES = [("no_shard", "resize"), ("optim", "resize"), ("optim_grads", "resize"),
         ("optim_grads_params", "resize"), ("optim_grads_params", "pool")]
CASE_IDS = ["z0", "z1", "z2", "z3-resize", "z3-pool"]
STEPS, LOCAL_BATCH, LAYERS = 3, 2, 4
GATHERS_PER_STEP_Z3 = 2 * LAYERS + 1  # each block forward + backward, the root once


def _run(style: str, zero: str, storage: str, env: Any, steps: int = STEPS, region: int = 2,
         **kwargs: Any) -> RunRecord:
    """Wrap ``build_net(style)`` and train it (Adam: amplifies any difference in the grads)."""
    net = build_net(style, region=region, device=kwargs.pop("build_device", None))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[RecomputeBlock], zero_dp_strategy=zero,
                                       fsdp_double_buffer=storage == "pool", **kwargs)
    if style == "wrapper_after":
        wrap_blocks(model.module)
    return train(model, opt, steps, LOCAL_BATCH, env.device)


def _check_parity(style: str, zero: str, storage: str, env: Any, **kwargs: Any) -> None:
    want = _run("none", zero, storage, env, **kwargs)
    got = _run(style, zero, storage, env, **kwargs)
    assert_bit_identical(got, want, f"{style} recompute, {zero}, {storage}")


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("zero,storage", CASES, ids=CASE_IDS)
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("zero"), recompute=matrix.param("style"))
def test_recompute_is_bit_identical_world2(style: str, zero: str, storage: str, dist_env: Any) -> None:
    _check_parity(style, zero, storage, dist_env)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("zero,storage", CASES, ids=CASE_IDS)
@pytest.mark.matrix(mesh=axes.mesh(4), zero=matrix.param("zero"), recompute=matrix.param("style"))
def test_recompute_is_bit_identical_world4(style: str, zero: str, storage: str, dist_env: Any) -> None:
    """4 ranks: ``mlp.fc2`` and the norms have 5 rows, so rank 3's shards are empty."""
    _check_parity(style, zero, storage, dist_env)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("style", MORE_STYLES)
@pytest.mark.parametrize("zero,storage", [CASES[1], CASES[3], CASES[4]], ids=["z1", "z3-resize", "z3-pool"])
@pytest.mark.matrix(mesh=axes.mesh(4), zero=matrix.param("zero"), recompute=matrix.param("style"))
def test_more_recompute_styles_are_bit_identical(style: str, zero: str, storage: str, dist_env: Any) -> None:
    """Reentrant ``checkpoint_wrapper``, the wrapper applied after ``fully_shard``, and one
    checkpoint around two units at a time (with the 2-slot pool: both units of a region fit)."""
    _check_parity(style, zero, storage, dist_env)


def _gathers_per_step(style: str, zero: str, storage: str, env: Any) -> list[int]:
    net = build_net(style)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[RecomputeBlock], zero_dp_strategy=zero,
                                       fsdp_double_buffer=storage == "pool")
    counts = []
    for step in range(2):
        x = torch.randn(LOCAL_BATCH, 4, 3, generator=torch.Generator().manual_seed(step)).to(env.device)
        with CollectiveCounter(["all_gather_into_tensor"]) as counter:
            model(x).square().mean().backward()
        counts.append(len(counter.calls))
        opt.step()
        opt.zero_grad()
    return counts


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("style", ["inside", "inside_reentrant", "wrapper", "wrapper_reentrant", "region"])
@pytest.mark.parametrize("zero,storage", [CASES[1], CASES[2], CASES[3], CASES[4]],
                         ids=["z1", "z2", "z3-resize", "z3-pool"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("zero"), recompute=matrix.param("style"))
def test_recompute_gathers_nothing_extra(style: str, zero: str, storage: str, dist_env: Any) -> None:
    """The all-gathers of a step with recompute equal those without; ZeRO-3: the closed form
    (a unit gathered twice per backward, or once more for its recompute, shows here)."""
    want = _gathers_per_step("none", zero, storage, dist_env)
    got = _gathers_per_step(style, zero, storage, dist_env)
    assert got == want, f"all-gathers per step with {style} recompute {got}, without {want}"
    if zero == "optim_grads_params":
        assert got == [GATHERS_PER_STEP_Z3] * 2, f"ZeRO-3 all-gathers per step {got}, closed form {GATHERS_PER_STEP_Z3}"


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", recompute="region")
def test_pool_too_small_for_a_recompute_region_is_a_clear_error(dist_env: Any) -> None:
    """Three units in one checkpointed region need three live slots during its recompute; the
    2-slot pool must refuse instead of overwriting a unit autograd still reads."""
    with pytest.raises(RuntimeError, match=r"spans more units than the pool's 2 slots"):
        _run("region", "optim_grads_params", "pool", dist_env, steps=1, region=3)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("style", ["inside", "wrapper"])
@pytest.mark.matrix(mesh=axes.mesh(2, outer=2), zero="optim_grads_params", outer=matrix.param("outer"),
                    recompute=matrix.param("style"))
def test_recompute_hsdp(style: str, outer: str, dist_env: Any) -> None:
    """HSDP (outer no_shard) and HFSDP (outer optim) on a (2 outer x 2 shard) mesh."""
    kwargs = seed_kwargs(seed_mesh((2, 2, 1, 1)), outer)
    _check_parity(style, "optim_grads_params", "resize", dist_env, **kwargs)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("shape", [(1, 2, 2, 1), (1, 2, 1, 2)], ids=["cp2", "tp2"])
@pytest.mark.matrix(mesh=matrix.param("shape", axes.mesh_shape), zero="optim_grads_params", recompute="inside")
def test_recompute_cp_tp_meshes(shape: tuple[int, int, int, int], dist_env: Any) -> None:
    _check_parity("inside", "optim_grads_params", "resize", dist_env, **seed_kwargs(seed_mesh(shape), None))


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("style", ["inside", "wrapper"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", recompute=matrix.param("style"))
def test_recompute_meta_init_and_decoupled_grads(style: str, dist_env: Any) -> None:
    """Meta-device init, and decoupled grads read by the precision-aware AdamW."""
    _check_parity(style, "optim_grads_params", "resize", dist_env, init_model_with_meta_device=True,
                  build_device="meta")
    for record_style in ("none", style):
        net = build_net(record_style)
        opt = fsdp_impl.optim.AdamW(net.parameters(), lr=1e-2, use_decoupled_grad=True)
        model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[RecomputeBlock], zero_dp_strategy=3,
                                           use_decoupled_grad=True)
        if record_style == "none":
            want = train(model, opt, STEPS, LOCAL_BATCH, dist_env.device)
        else:
            assert_bit_identical(train(model, opt, STEPS, LOCAL_BATCH, dist_env.device), want,
                                 f"{style} recompute with decoupled grads")


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("keep_transpose", [False, True], ids=["regather", "keep"])
@pytest.mark.parametrize("zero", ["optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("recipe", ["current", "delayed", "blockwise"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("zero"), recipe=matrix.param("recipe"), model="fp8_mlp",
                    dtype="bf16", recompute="inside")
def test_recompute_fp8_params(recipe: str, zero: str, keep_transpose: bool, dist_env: Any) -> None:
    """Torch-native FP8 parameters: the recompute uses the forward's FP8 weights and scales (with
    ``keep_fp8_transpose_cache`` the backward gathers no FP8 bytes and the recompute takes the
    kept transpose back, exactly), so training is bit-identical to no recompute; delayed scaling
    records the recomputed casts' amaxes into the same per-step maximum."""
    runs = {}
    for recompute in (False, True):
        model, opt = fp8_training.wrap(fp8_training.build(recipe, recompute=recompute), strategy=zero,
                                       keep_fp8_transpose_cache=keep_transpose)
        losses = fp8_training.train_fsdp(model, opt, dist_env.rank, STEPS, 1, dist_env.device)
        runs[recompute] = (losses, fp8_training.full_params(model))
    assert runs[True][0] == runs[False][0], f"losses {runs[True][0]} != {runs[False][0]}"
    bad = [n for n, p in runs[False][1].items() if not torch.equal(runs[True][1][n], p)]
    assert not bad, f"trained params differ for {bad}"


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("style", ["none", "inside", "selective", "wrapper"])
@pytest.mark.parametrize("zero,storage", [CASES[1], CASES[3], CASES[4]], ids=["z1", "z3-resize", "z3-pool"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("zero"), recompute=matrix.param("style"))
def test_fine_grained_param_gather_is_bit_identical(style: str, zero: str, storage: str, dist_env: Any) -> None:
    """``enable_fine_grained_param_gather=True`` (Megatron-FSDP's per-submodule unshard hooks)
    trains exactly as the per-unit gather without recompute, with the same all-gathers."""
    want = _run("none", zero, storage, dist_env)
    got = _run(style, zero, storage, dist_env, enable_fine_grained_param_gather=True)
    assert_bit_identical(got, want, f"fine-grained gather, {style} recompute, {zero}, {storage}")


def _forward_events(fine_grained: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(event, name) of the first forward: unit gathers, and the pre-forward of ``blocks.0`` and
    of its first submodule (user hooks registered after the wrap run after the engine's)."""
    from fsdp_impl.unit import FSDPUnit

    events: list[tuple[str, str]] = []
    original = FSDPUnit._start_gather
    monkeypatch.setattr(FSDPUnit, "_start_gather", lambda self: (events.append(("gather", self.name)),
                                                                 original(self))[1])
    model = fsdp_impl.fully_shard_model(build_net("none"), fsdp_unit_modules=[RecomputeBlock],
                                        overlap_param_gather=False, enable_fine_grained_param_gather=fine_grained)
    block = model.module.blocks[0]
    block.register_forward_pre_hook(lambda *_: events.append(("enter", "blocks.0")))
    block.norm0.register_forward_pre_hook(lambda *_: events.append(("enter", "blocks.0.norm0")))
    model(torch.randn(LOCAL_BATCH, 4, 3))
    return events


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", recompute="none")
def test_fine_grained_gather_happens_at_the_first_submodule(dist_env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Megatron-FSDP 0.6.1's semantics: the unit's pre-forward gathers nothing; the pre-forward
    of its first submodule holding params does (without the switch: the unit's own)."""
    per_unit = _forward_events(False, monkeypatch)
    assert per_unit.index(("gather", "blocks.0")) < per_unit.index(("enter", "blocks.0")), per_unit
    fine = _forward_events(True, monkeypatch)
    assert (fine.index(("enter", "blocks.0")) < fine.index(("gather", "blocks.0"))
            < fine.index(("enter", "blocks.0.norm0"))), fine


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", recompute="none")
def test_fine_grained_submodule_outside_its_unit_is_a_clear_error(dist_env: Any) -> None:
    """A unit's submodule called on its own (outside the unit's forward and any recompute) gets
    an error naming the module and the unit instead of aten's DTensor/Tensor mix-up."""
    model = fsdp_impl.fully_shard_model(build_net("none"), fsdp_unit_modules=[RecomputeBlock],
                                        enable_fine_grained_param_gather=True)
    with pytest.raises(RuntimeError, match=r"Linear holds params of FSDP unit 'blocks.1' but ran outside that "
                                           r"unit's forward.*add its class to fsdp_unit_modules"):
        model.module.blocks[1].mlp.fc1(torch.randn(2, 5))
