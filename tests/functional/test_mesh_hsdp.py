"""HSDP (outer no_shard) and HFSDP (outer optim) on a (dp_outer=2, dp_shard=2) mesh.

Numbers: every case trains 3 steps of 2 accumulation microbatches (no sync, then sync) with SGD
(momentum; scale-sensitive, so a wrong average across dp_outer shows) and compares per-step losses
and final params with a single-process reference on the union of all ranks' data.
Tolerance 1e-5 relative (fp32; measured <= 1e-6: only the order of sums differs).

Traffic: a ``CollectiveCounter`` checks each collective's group: HSDP all-reduces across dp_outer
only on the sync microbatch (once per unit with grads per cycle), reduce-scatters/all-gathers
stay inside dp_shard; HFSDP gathers and reduce-scatters over the hybrid group and never issues a
separate outer reduction. The checks live in ``common/mesh_checks.py`` (``test_mesh_world2.py``
runs them on 2 ranks).
"""
from __future__ import annotations

import pytest

from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.mesh import full_params
from tests.functional.common.mesh_checks import (
    assert_parity,
    check_hfsdp,
    check_hsdp,
    hsdp_reference,
    hsdp_train,
    hsdp_wrap,
)

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=600),
    pytest.mark.matrix(mesh=axes.mesh(2, outer=2), dtype="fp32"),
]

HSDP_4 = (2, 2, 1, 1)  # (dp_outer, dp_shard, cp, tp) of the 4-rank cases


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), outer="no_shard", model=matrix.param("name"))
def test_hsdp_parity_and_traffic(name: str, strategy: str, dist_env) -> None:
    check_hsdp(name, strategy, dist_env.device, HSDP_4)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.matrix(zero="optim_grads_params", outer="optim", model=matrix.param("name"))
def test_hfsdp_parity_and_traffic(name: str, dist_env) -> None:
    check_hfsdp(name, dist_env.device, HSDP_4)


@pytest.mark.matrix(zero="optim_grads_params", outer="no_shard", model="cnn")
def test_hsdp_adam_accumulation_matches_reference(dist_env) -> None:
    """Adam as Megatron-FSDP's test uses it (outer no_shard, inner ZeRO-3): losses and params
    (measured: losses equal, params within 8.8e-8)."""
    mesh, model, opt = hsdp_wrap("cnn", 3, "no_shard", dist_env.device, HSDP_4, opt_kind="adam")
    losses = hsdp_train("cnn", model, opt, mesh, dist_env.device)
    assert_parity(losses, full_params(model), *hsdp_reference("cnn", dist_env.device, "adam"))
