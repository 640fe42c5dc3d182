"""The mesh shapes on 2 ranks, so they run on a 2-GPU machine (NCCL, one GPU a rank).

The 4-rank suites (``test_mesh_hsdp.py``, ``test_mesh_tp_cp.py``) need 4 GPUs under NCCL; these
cases run their checks (``common/mesh_checks.py``) on the 2-rank meshes that still mean
something, (dp_outer, dp_shard, cp, tp):

- HSDP (2,1,1,1), outer ``no_shard``, inner strategies 0..3: parity, and the dp_outer all-reduce
  only on the sync microbatch (one per unit with grads), nothing on other groups.
- HFSDP (2,1,1,1), outer ``optim``, inner 3: parity, gathers/reduce-scatters only over the
  hybrid group, no outer all-reduce, params and optimizer state sharded 2 ways.
- CP (1,1,2,1) with ``dp_shard_dim='dp_shard_cp'``: sequence chunks train like full sequences.
- TP-plain (1,1,1,2): a plain model replicated over tp trains like the reference, no FSDP
  traffic over tp.
- plain FSDP (1,2,1,1): parity, every engine collective on the dp_shard group.

Each trains 3 steps x 2 microbatches (no sync, then sync) with SGD+momentum and compares per-step
losses and final params with the single-process reference at 1e-5 relative (fp32), the same
numbers the 4-rank cases check. The device comes from ``dist_env`` (CUDA under NCCL, else CPU).
"""
from __future__ import annotations

import pytest

from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.collective_counter import group_ranks
from tests.functional.common.mesh_checks import check_cp, check_hfsdp, check_hsdp, check_tp, train_plain_cnn

pytestmark = [
    pytest.mark.distributed(world_size=2, timeout=300),
    pytest.mark.matrix(dtype="fp32"),
]

HSDP_2 = (2, 1, 1, 1)
CP_2 = (1, 1, 2, 1)
TP_2 = (1, 1, 1, 2)
PLAIN_2 = (1, 2, 1, 1)
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.matrix(mesh=axes.mesh(1, outer=2), zero=matrix.param("strategy", axes.zero), outer="no_shard", model="cnn")
def test_hsdp_world2(strategy: str, dist_env) -> None:
    check_hsdp("cnn", strategy, dist_env.device, HSDP_2)


@pytest.mark.parametrize("name", ["cnn", "transformer"])
@pytest.mark.matrix(mesh=axes.mesh(1, outer=2), zero="optim_grads_params", outer="optim", model=matrix.param("name"))
def test_hfsdp_world2(name: str, dist_env) -> None:
    check_hfsdp(name, dist_env.device, HSDP_2)


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.matrix(mesh=axes.mesh(1, cp=2), zero=matrix.param("strategy", axes.zero), model="token_model")
def test_cp_world2(strategy: str, dist_env) -> None:
    check_cp(CP_2, None, strategy, dist_env.device)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.matrix(mesh=axes.mesh(1, tp=2), zero=matrix.param("strategy", axes.zero), model="cnn")
def test_tp_plain_world2(strategy: str, dist_env) -> None:
    check_tp(TP_2, None, strategy, dist_env.device)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("strategy", axes.zero), model="cnn")
def test_plain_fsdp_world2(strategy: str, dist_env) -> None:
    mesh, _, counter = train_plain_cnn(PLAIN_2, None, strategy, dist_env.device)
    shard = group_ranks(mesh["dp_shard"].get_group())
    assert shard == (0, 1)
    assert counter.calls and all(ranks == shard for _, ranks in counter.calls), counter.summary()
    if strategy == "optim_grads_params":
        assert counter.count("reduce_scatter_tensor", ranks=shard) > 0, counter.summary()
        assert counter.count("all_gather_into_tensor", ranks=shard) > 0, counter.summary()
