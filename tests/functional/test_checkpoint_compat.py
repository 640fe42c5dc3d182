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
import torch.distributed as dist

import fsdp_impl
from fsdp_impl.checkpoint import CheckpointCorruptedError
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.golden_cells import Cell, band_dtype, one_thread, start_cell, train_steps

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
