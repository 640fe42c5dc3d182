"""Checkpoint compatibility between releases (``pytest -m golden``): small checkpoints written by
an earlier version are committed under ``tests/golden/checkpoints/<cell>/`` (model + optimizer,
DCP through ``fsdp_impl.checkpoint``); every later version must load them into a freshly wrapped
model and train on to the curve that run continued with (``tests/golden/<platform>/ckpt_<cell>.json``,
bit for bit on CPU), or refuse at load time naming the format version it found and the ones it reads.

A fixture is written only when it is missing and ``--golden-update`` is given, never
overwritten: a new checkpoint format must keep loading the committed ones (or refuse them
clearly). Its continuation curve is a golden file like any other.
"""
from __future__ import annotations

import json
import pathlib
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fsdp_impl
from fsdp_impl.checkpoint import CheckpointCorruptedError
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common import checkpoint_interop as interop
from tests.functional.common.checkpointing import assert_same_state
from tests.functional.common.golden_cells import Cell, band_dtype, one_thread, start_cell, train_steps
from tests.functional.common.models import GPTBlock, build_model
from tests.functional.common.numerics import assert_losses_close

pytestmark = [pytest.mark.golden, pytest.mark.pinned_numerics, pytest.mark.matrix(graph="eager")]
FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "golden" / "checkpoints"
BEFORE, AFTER = 5, 10  # steps before the save, steps the curve continues for
W2 = pytest.mark.distributed(world_size=2)
W4 = pytest.mark.distributed(world_size=4)
COMPAT = pytest.mark.checkpoint_compat  # the sign-off's "Checkpoint compatibility" lists these tests
CELLS = [
    pytest.param(Cell("zero3", 2), marks=[W2, COMPAT("zero3")], id="zero3"),
    pytest.param(Cell("fp8_current", 2, model="fp8", recipe="current"), marks=[W2, COMPAT("fp8_current")],
                 id="fp8_current"),
    pytest.param(Cell("hsdp", 4, mesh=(2, 2, 1, 1), outer="no_shard"), marks=[W4, COMPAT("hsdp")], id="hsdp"),
]


def keep_implementation(opt: Any) -> None:
    """Step with the cell's own Adam implementation (fused) after the load: a load restores the
    saved hyperparameters, and the committed fixtures were saved by the default (unfused) Adam,
    whose CPU ``sqrt`` runs in MKL's vector math, whose bits follow the CPU (``harness.numerics``).
    The state (moments, step) is the same for both; only the kernel differs."""
    for group in opt.param_groups:
        group["fused"], group["foreach"] = True, None


def _fixture_dir(cell: Cell) -> pathlib.Path:
    return FIXTURES / cell.name


def _write_fixture(cell: Cell, device: Any, path: pathlib.Path) -> None:
    run = start_cell(cell, device)
    train_steps(run, range(BEFORE))
    fsdp_impl.checkpoint.save(path, run.model, run.opt, extra={"step": BEFORE, "cell": cell.name})


@pytest.mark.parametrize("cell", CELLS)
@pytest.mark.matrix(mesh=matrix.param("cell", lambda c: axes.mesh_shape(c.mesh) if c.mesh else axes.mesh(c.world)),
                    zero="optim_grads_params", outer=axes.item("cell", "outer", axes.outer),
                    model=axes.item("cell", "model"), dtype="fp32")
def test_checkpoint_of_an_earlier_version_loads_and_continues_its_curve(cell: Cell, dist_env: Any,
                                                                        golden: Any) -> None:
    path = _fixture_dir(cell)
    with one_thread(), golden.recording(dist_env.device):
        if not path.exists():
            if not golden.update:
                pytest.fail(f"no checkpoint fixture {path}: make it with `python -m pytest -m golden --golden-update "
                            "tests/functional/test_checkpoint_compat.py` and commit it")
            _write_fixture(cell, dist_env.device, path)
        run = start_cell(cell, dist_env.device)
        extra = fsdp_impl.checkpoint.load(path, run.model, run.opt)
        assert extra == {"step": BEFORE, "cell": cell.name}, extra
        keep_implementation(run.opt)
        series = train_steps(run, range(BEFORE, BEFORE + AFTER))
    golden.check(f"ckpt_{cell.name}", series, dtype=band_dtype(cell), device=dist_env.device,
                 note=f"continues tests/golden/checkpoints/{cell.name} for {AFTER} steps; pinned numerics")


@W2
@COMPAT("zero3, manifest set to format 99", check="an unknown future format is refused before anything loads")
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="gpt", dtype="fp32")
def test_a_checkpoint_of_an_unknown_future_format_is_refused(dist_env: Any, shared_tmp_path: pathlib.Path) -> None:
    """A copy of the zero3 fixture whose manifest claims format version 99 is refused before
    anything is loaded, naming the version found and the versions this code reads."""
    source = _fixture_dir(Cell("zero3", 2))
    if not source.exists():
        pytest.fail(f"no checkpoint fixture {source}: make it with `python -m pytest -m golden --golden-update`")
    future = shared_tmp_path / "future"
    if dist.get_rank() == 0:
        shutil.copytree(source, future)
        manifest = future / "manifest.json"
        body = json.loads(manifest.read_text())
        body["version"] = 99
        manifest.write_text(json.dumps(body))
    dist.barrier()
    run = start_cell(Cell("zero3", 2), dist_env.device)
    before = {n: p.full_tensor().clone() for n, p in run.model.module.named_parameters()}
    with pytest.raises(CheckpointCorruptedError, match=r"has format version 99; this code reads versions"):
        fsdp_impl.checkpoint.load(future, run.model, run.opt)
    after = {n: p.full_tensor() for n, p in run.model.module.named_parameters()}
    assert all((before[n] == after[n]).all() for n in before), "a refused load changed the model"


# Checkpoints of other engines, committed once (tests/golden/checkpoints/make_foreign_fixtures.py
# says how each was made): every later version must keep loading them into ours and continuing.
FSDP2_FIXTURE = FIXTURES / "fsdp2"
MEGATRON_FIXTURE = FIXTURES / "megatron_fsdp"
MEGATRON_RTOL = 1e-5  # see the Megatron-FSDP test


@W2
@COMPAT("fsdp2", check="FSDP2's checkpoint (world 4) loads into ours at world 2 and continues like FSDP2 resuming it")
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="gpt", dtype="fp32")
def test_fsdp2_checkpoint_continues_in_ours_like_in_fsdp2(dist_env: Any) -> None:
    """The reference is FSDP2 itself resuming the committed files at this world size (same
    process, same platform): right after the load and after ``N_AFTER`` steps, parameters, AdamW
    moments, step counts and every loss agree bit for bit."""
    steps = range(interop.K_SAVE, interop.K_SAVE + interop.N_AFTER)
    with one_thread():
        model, optimizer = interop.resume_fsdp2(FSDP2_FIXTURE, "fsdp2_torch")
        at_load = interop.full_state(model, optimizer)
        expected_losses = interop.train(model, optimizer, steps)
        expected = interop.full_state(model, optimizer)
        ours, opt = interop.ours(seed=1234, config=interop.Ours(3), lr=interop.RESUME_LR)
        assert fsdp_impl.checkpoint.load(FSDP2_FIXTURE, ours, opt) == {}
        assert_same_state(interop.full_state(ours, opt), at_load, None, "ours vs FSDP2 right after the load")
        losses = interop.train(ours, opt, steps)
    assert losses == expected_losses, f"ours {losses} != FSDP2 {expected_losses}"
    assert_same_state(interop.full_state(ours, opt), expected, None, "ours vs FSDP2 after the continuation")


def _read_whole(path: pathlib.Path, keys: list[str]) -> dict[str, Any]:
    """Entries of a DCP checkpoint as whole CPU tensors, read by torch's DCP alone (one process)."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(metadata[k].size), dtype=metadata[k].properties.dtype) for k in keys}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


@W2
@COMPAT("megatron_fsdp", check="Megatron-FSDP 0.6.1's checkpoint (world 4, uneven chunks, position-keyed optimizer "
                               "state) loads into ours at world 2 and continues like Megatron-FSDP resuming it")
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="gpt", dtype="fp32")
def test_megatron_fsdp_checkpoint_continues_in_ours_like_in_megatron_fsdp(dist_env: Any) -> None:
    """Right after the load, ours holds exactly what torch's own DCP reader finds in the files
    (parameters under ``model.module.<fqn>``, AdamW moments and step counts under
    ``optimizer.state.<position>``; Megatron-FSDP's ``fully_shard`` made one param group over
    ``model.parameters()``, so ours is built the same way and positions follow the model). The
    continuation is compared with Megatron-FSDP's own resume of these files at world 2
    (``reference.pt``, recorded by the generator): on the machine that recorded it the agreement
    is exact (measured: 0.0 on every loss and parameter); ``MEGATRON_RTOL`` = 1e-5 only admits
    another CPU's last-bit matmul differences over 10 steps (a lost moment or an off-by-one step
    count moves the parameters by ~1e-3)."""
    steps = range(interop.K_SAVE, interop.K_SAVE + interop.N_AFTER)
    reference = torch.load(MEGATRON_FIXTURE / "reference.pt", weights_only=True)
    with one_thread():
        module = build_model("gpt", seed=1234)
        ours, opt = fsdp_impl.fully_shard(module, torch.optim.AdamW(module.parameters(), lr=interop.RESUME_LR),
                                          fsdp_unit_modules=[GPTBlock], zero_dp_strategy=3)
        assert fsdp_impl.checkpoint.load(MEGATRON_FIXTURE, ours, opt) == {}
        assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(interop.LR, 0.01)]
        at_load = interop.full_state(ours, opt)
        names = [n for n, _ in ours.module.named_parameters()]
        positions = {n: i for i, n in enumerate(names)}
        keys = [f"model.module.{n}" for n in names] + [f"optimizer.state.{positions[n]}.{k}" for n in names
                                                     for k in ("exp_avg", "exp_avg_sq", "step")]
        files = _read_whole(MEGATRON_FIXTURE, keys)
        for n in names:
            assert torch.equal(at_load[n], files[f"model.module.{n}"]), n
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(at_load[f"{n}:{k}"], files[f"optimizer.state.{positions[n]}.{k}"]), f"{n}:{k}"
        losses = interop.train(ours, opt, steps)
        final = interop.full_state(ours, opt)
    assert_losses_close(losses, reference["losses"], MEGATRON_RTOL, "ours vs Megatron-FSDP's continuation")
    assert_same_state({n: final[n] for n in names}, reference["params"], MEGATRON_RTOL,
                      "ours vs Megatron-FSDP's continuation (parameters)")

