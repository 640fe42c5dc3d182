"""Context-parallel and (plain-model) tensor-parallel mesh dims on 4 ranks.

CP: a per-token model (no mixing across positions, so a sequence can be split) is trained with
the ranks of the ``cp`` dim seeing different sequence chunks of the same samples; with
``dp_shard_dim='dp_shard_cp'`` their grads are averaged together with the data-parallel ones, so
the result must equal a single-process model trained on the full sequences of all samples.
TP: a plain model is replicated over a ``tp`` dim of size 2; TP ranks see the same data, so
data-parallel semantics are unchanged and training must match the reference over the dp ranks.

Every case: 3 steps x 2 accumulation microbatches (no sync, then sync), SGD with momentum,
per-step loss and final params vs the reference at 1e-5 relative (fp32). The checks live in
``common/mesh_checks.py`` (``test_mesh_world2.py`` runs them on 2 ranks).
"""
from __future__ import annotations

import pytest

from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.mesh_checks import check_cp, check_tp

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=600),
    pytest.mark.matrix(dtype="fp32"),
]


@pytest.mark.parametrize("mesh_shape,outer", [((1, 2, 2, 1), None), ((2, 1, 2, 1), "no_shard"),
                                              ((2, 1, 2, 1), "optim")], ids=["fsdp", "hsdp", "hfsdp"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.matrix(mesh=matrix.param("mesh_shape", axes.mesh_shape), zero=matrix.param("strategy", axes.zero),
                    outer=matrix.param("outer", axes.outer), model="token_model")
def test_cp_sequence_chunks_match_full_sequence(mesh_shape, outer, strategy, dist_env) -> None:
    if outer == "optim" and strategy != "optim_grads_params":
        pytest.skip("outer 'optim' requires inner 'optim_grads_params'/3")
    check_cp(mesh_shape, outer, strategy, dist_env.device)


@pytest.mark.parametrize("mesh_shape,outer", [((1, 2, 1, 2), None), ((2, 1, 1, 2), "no_shard")],
                         ids=["fsdp_tp2", "hsdp_tp2"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.matrix(mesh=matrix.param("mesh_shape", axes.mesh_shape), zero=matrix.param("strategy", axes.zero),
                    outer=matrix.param("outer", axes.outer), model="cnn")
def test_tp_dim_replicates_plain_models(mesh_shape, outer, strategy, dist_env) -> None:
    check_tp(mesh_shape, outer, strategy, dist_env.device)
