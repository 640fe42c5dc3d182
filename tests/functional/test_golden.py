"""Golden cells (``pytest -m golden``): fixed-seed runs against the reviewed per-platform files in
``tests/golden/<platform>/`` (``common/golden_cells.py`` lists the cells, ``harness.golden``
compares and, with ``--golden-update``, rewrites them).

Tolerances. CPU cells run on gloo with pinned numerics (``pinned_numerics``: one intra-op thread,
ATen's baseline kernels, MKL's reproducible path, oneDNN off; ``harness.numerics``), so their bits
do not depend on the machine: where the run's fingerprint equals the file's, every series must match
bit for bit (tolerance 0). GPU cells run at world 1 with ``torch.use_deterministic_algorithms`` and a
fixed cuBLAS workspace, so they are compared exactly too; a cell that is not deterministic there gets
a tolerance measured from repeated runs, written next to it in ``GPU_TOLERANCE`` with the numbers.
Where the fingerprints differ (another torch, another GPU stack), a cell is compared within the band
its file holds (measured cross-platform spread, ``harness.golden_band``).
"""
from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.golden_cells import CELLS, GPU_CELLS, Cell, band_dtype, run_cell

# Deterministic cuBLAS (read when the first cuBLAS handle is made: before any test of this bucket).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

pytestmark = [pytest.mark.golden, pytest.mark.pinned_numerics, pytest.mark.matrix(graph="eager")]
CPU_TOLERANCE = 0.0
GPU_TOLERANCE: dict[str, float] = {}  # cell -> measured relative tolerance, where runs are not bit-identical


def _mesh(cell: Cell) -> str:
    return axes.mesh(cell.world) if cell.mesh is None else axes.mesh_shape(cell.mesh)


def _cell_axes() -> pytest.MarkDecorator:
    return pytest.mark.matrix(mesh=matrix.param("cell", _mesh), zero=axes.item("cell", "zero", axes.zero),
                              outer=axes.item("cell", "outer", axes.outer), model=axes.item("cell", "model"),
                              dtype=axes.item("cell", "dtype", axes.dtype),
                              recipe=axes.item("cell", "recipe", lambda r: None if r is None else axes.recipe(r)),
                              recompute=axes.item("cell", "model", lambda m: "inside" if m == "recompute" else None),
                              offload=axes.item("cell", "offload"))


def _cells(world: int) -> list[Any]:
    return [pytest.param(c, id=c.name) for c in CELLS if c.world == world]


def _check(cell: Cell, dist_env: Any, golden: Any) -> None:
    with golden.recording(dist_env.device):
        series = run_cell(cell, dist_env.device)
    golden.check(cell.name, series, tolerance=CPU_TOLERANCE, dtype=band_dtype(cell), device=dist_env.device,
                 note="CPU/gloo, pinned numerics: the same bits on every x86-64 machine; compared bit for bit")


@pytest.mark.distributed(world_size=1)
@pytest.mark.parametrize("cell", _cells(1))
@_cell_axes()
def test_golden_world1(cell: Cell, dist_env: Any, golden: Any) -> None:
    _check(cell, dist_env, golden)


@pytest.mark.distributed(world_size=2)
@pytest.mark.parametrize("cell", _cells(2))
@_cell_axes()
def test_golden_world2(cell: Cell, dist_env: Any, golden: Any) -> None:
    _check(cell, dist_env, golden)


@pytest.mark.distributed(world_size=4)
@pytest.mark.parametrize("cell", _cells(4))
@_cell_axes()
def test_golden_world4(cell: Cell, dist_env: Any, golden: Any) -> None:
    _check(cell, dist_env, golden)


def _gpu_cells(te: bool) -> list[Any]:
    return [pytest.param(c, id=c.name) for c in GPU_CELLS if (c.model == "te") == te]


def _check_gpu(cell: Cell, dist_env: Any, golden: Any, deterministic: bool) -> None:
    torch.use_deterministic_algorithms(deterministic)
    try:
        with golden.recording(dist_env.device):
            series = run_cell(cell, dist_env.device)
    finally:
        torch.use_deterministic_algorithms(False)
    golden.check(cell.name, series, tolerance=GPU_TOLERANCE.get(cell.name, 0.0), dtype=band_dtype(cell),
                 note=f"one GPU, deterministic algorithms {'on' if deterministic else 'off (TE)'}, "
                      "CUBLAS_WORKSPACE_CONFIG=:4096:8", device=dist_env.device)


@pytest.mark.requires_cuda
@pytest.mark.distributed(world_size=1, timeout=600)
@pytest.mark.parametrize("cell", _gpu_cells(te=False))
@_cell_axes()
def test_golden_gpu(cell: Cell, dist_env: Any, golden: Any) -> None:
    _check_gpu(cell, dist_env, golden, deterministic=True)


# TE cells run in rank processes of their own (bucket "golden_te") and without torch's
# deterministic mode: after the deterministic cells in the same process, TE 2.20.2's cuDNN load
# failed on the H200 image ("libcudnn_heuristic.so.9: undefined symbol"); alone they pass. Their
# determinism is checked run against run (two checks after an update, bit-identical).
@pytest.mark.requires_cuda
@pytest.mark.requires_module("transformer_engine")
@pytest.mark.distributed(world_size=1, timeout=600, bucket="golden_te")
@pytest.mark.parametrize("cell", _gpu_cells(te=True))
@_cell_axes()
def test_golden_gpu_te(cell: Cell, dist_env: Any, golden: Any) -> None:
    _check_gpu(cell, dist_env, golden, deterministic=False)


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="gpt", dtype="fp32")
def test_a_learning_rate_change_of_1e_6_drifts(dist_env: Any, golden: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden comparison can fail: the zero3 cell with its learning rate changed by a relative
    1e-6 no longer matches its golden file (the check under --golden-update would rewrite it, so
    this runs the comparison itself)."""
    from harness.golden import SeriesDrift

    monkeypatch.delenv("HARNESS_GOLDEN_UPDATE", raising=False)
    cell = next(c for c in CELLS if c.name == "zero3")
    stored = golden.path(cell.name, dist_env.device)
    if not stored.exists():
        pytest.fail(f"no golden file {stored}: make it with `python -m pytest -m golden --golden-update`")
    import json

    want = json.loads(stored.read_text())["series"]
    got = run_cell(cell, dist_env.device, lr_scale=1 + 1e-6)
    drifts = {k: SeriesDrift(got[k], want[k], CPU_TOLERANCE) for k in got}
    for d in drifts.values():
        d.compare()
    assert drifts["loss"].first_drift_step is not None, "a 1e-6 learning-rate change left the loss curve unchanged"
    assert drifts["param_checksum"].first_drift_step == 0, drifts["param_checksum"].as_dict()


@pytest.mark.distributed(world_size=2)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="gpt", dtype="fp32")
def test_a_learning_rate_change_of_1e_3_leaves_the_band(dist_env: Any, golden: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a machine's fingerprint differs from the file's, the cell is compared within its
    measured band instead of bit for bit; the band must still catch a real change: the zero3
    cell with its learning rate changed by a relative 1e-3 drifts out of it (and the run that is
    not perturbed lies inside it)."""
    from harness import golden_file
    from harness.golden import SeriesDrift

    monkeypatch.delenv("HARNESS_GOLDEN_UPDATE", raising=False)
    cell = next(c for c in CELLS if c.name == "zero3")
    stored = golden_file.read(golden.path(cell.name, dist_env.device))
    if stored is None or set(stored.band) != {"loss", "grad_norm", "param_checksum"}:
        pytest.fail(f"{golden.path(cell.name, dist_env.device)} holds no band for every series: measure it "
                    "(python -m harness.golden_band, see tests/golden/README.md)")
    drifted = []
    for scale in (1.0, 1.001):
        got = run_cell(cell, dist_env.device, lr_scale=scale)
        drifts = {k: SeriesDrift(got[k], stored.series[k], stored.band[k]) for k in got}
        for d in drifts.values():
            d.compare()
        drifted.append(sorted(k for k, d in drifts.items() if d.first_drift_step is not None))
    assert drifted[0] == [], f"the unperturbed run left the band: {drifted[0]}"
    assert drifted[1], f"a 1e-3 learning-rate change stayed inside the band {stored.band}"
