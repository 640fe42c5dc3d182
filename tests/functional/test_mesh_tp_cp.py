"""Context-parallel and (plain-model) tensor-parallel mesh dims on 4 ranks (issue 4).

CP: a per-token model (no mixing across positions, so a sequence can be split) is trained with
the ranks of the ``cp`` dim seeing different sequence chunks of the same samples; with
``dp_shard_dim='dp_shard_cp'`` their grads are averaged together with the data-parallel ones, so
the result must equal a single-process model trained on the full sequences of all samples.
TP: a plain model is replicated over a ``tp`` dim of size 2; TP ranks see the same data, so
data-parallel semantics are unchanged and training must match the reference over the dp ranks.

Every case: 3 steps x 2 accumulation microbatches (no sync, then sync), SGD with momentum,
per-step loss and final params vs the reference at 1e-5 relative (fp32). ``check_cp``,
``check_tp`` and ``train_plain_cnn`` take the mesh shape and the device, so
``test_mesh_world2.py`` runs the same checks with 2 ranks (2 GPUs under NCCL).
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from fsdp_impl import fully_shard
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.collective_counter import CollectiveCounter, group_ranks
from tests.functional.common.models import build_model, loss_fn, unit_classes
from tests.functional.common.reference import global_batch, make_optimizer
from tests.functional.common.training import Microbatch, train_accumulating
from tests.functional.test_mesh_support import (
    assert_same_on_all_ranks,
    data_position,
    full_params,
    relative_errors,
    seed_kwargs,
    seed_mesh,
)

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=600),
    pytest.mark.matrix(dtype="fp32"),
]

RTOL = 1e-5
STEPS, MICRO, SAMPLES_PER_DP, SEQ, D = 3, 2, 2, 4, 4
Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]
Shape = tuple[int, int, int, int]  # (dp_outer, dp_shard, cp, tp)


class TokenBlock(nn.Module):
    """Residual per-token MLP: position i's output depends only on position i."""

    def __init__(self, d: int = D, hidden: int = 8) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class TokenModel(nn.Module):
    def __init__(self, d: int = D, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TokenBlock(d) for _ in range(layers)])
        self.head = nn.Linear(d, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, seq, d)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _token_model() -> nn.Module:
    torch.manual_seed(0)
    return TokenModel()


def _token_batch(step: int, n: int) -> Batch:
    gen = torch.Generator().manual_seed(500 + step)
    return (torch.randn(n, SEQ, D, generator=gen),), torch.randn(n, SEQ, 3, generator=gen)


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _reference(build: Callable[[], nn.Module], batch: Callable[[int, int], Batch], loss: Callable,
               n: int, device: torch.device) -> tuple[list[float], dict]:
    """Full-batch training on ``device`` (like kernels with like); params returned on the CPU."""
    model = build().to(device)
    opt = make_optimizer("sgd", model.named_parameters())
    losses = []
    for step in range(STEPS):
        inputs, target = batch(step, n)
        value = loss(model(*[x.to(device) for x in inputs]), target.to(device))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


def _train(build, batch, loss, units, mesh, outer: str | None, strategy, split_seq: bool,
           device: torch.device, counter: CollectiveCounter | None = None):
    """This rank trains on its samples (by dp position) and, if ``split_seq``, its sequence chunk
    (by cp position); TP ranks get identical data."""
    model = build()
    opt = make_optimizer("sgd", model.named_parameters())
    fsdp_model, opt = fully_shard(model, opt, fsdp_unit_modules=units, zero_dp_strategy=strategy,
                                  **seed_kwargs(mesh, outer))
    # moved to the device: the check all-reduces them, and NCCL cannot reduce CPU tensors
    initial = {n: t.to(device) for n, t in full_params(fsdp_model).items()}
    assert_same_on_all_ranks(initial, "initial params")
    dp_pos, dp_n = data_position(mesh["dp"].get_group())
    cp_pos, cp_n = data_position(mesh["cp"].get_group())
    per = SAMPLES_PER_DP // MICRO

    def microbatches(step: int) -> list[Microbatch]:
        inputs, target = batch(step, dp_n * SAMPLES_PER_DP)
        out = []
        for m in range(MICRO):
            lo = dp_pos * SAMPLES_PER_DP + m * per
            xs, y = [x[lo:lo + per] for x in inputs], target[lo:lo + per]
            if split_seq:
                xs, y = [x.chunk(cp_n, dim=1)[cp_pos] for x in xs], y.chunk(cp_n, dim=1)[cp_pos]
            out.append(([x.to(device) for x in xs], y.to(device)))
        return out

    record = (lambda step, m: counter) if counter is not None else None
    losses = train_accumulating(fsdp_model, opt, STEPS, microbatches, loss, device, record)
    return losses, full_params(fsdp_model), fsdp_model


def _assert_parity(losses, final, ref_losses, ref_params) -> None:
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) <= RTOL * abs(b), f"losses {losses} vs reference {ref_losses}"
    err, where = relative_errors(final, ref_params)
    assert err <= RTOL, f"param {where}: relative error {err:.3g}"


def check_cp(mesh_shape: Shape, outer: str | None, strategy: str, device: torch.device) -> None:
    """Sequence chunks over ``cp`` (dp_shard_dim = the flattened dp_shard x cp dim) train like
    full sequences, and grads are reduced over groups that contain the cp ranks."""
    mesh = seed_mesh(mesh_shape, device.type)
    counter = CollectiveCounter()
    losses, final, model = _train(_token_model, _token_batch, _mse, [TokenBlock], mesh, outer, strategy,
                                  split_seq=True, device=device, counter=counter)
    n_samples = mesh["dp"].size() * SAMPLES_PER_DP
    _assert_parity(losses, final, *_reference(_token_model, _token_batch, _mse, n_samples, device))
    cp_ranks = group_ranks(mesh["cp"].get_group())
    shard = group_ranks(model.dist_index.get_fsdp_group())
    assert set(cp_ranks) <= set(shard), "cp ranks must be inside the dp_shard_cp group"
    reduced = {r for op, r in counter.calls if op == "reduce_scatter_tensor"}
    # HFSDP's second level reduces the (already cp-reduced) inner shards across dp_outer only
    outer_ranks = group_ranks(model.dist_index.get_outer_fsdp_group()) if outer == "optim" else None
    assert any(set(cp_ranks) <= set(r) for r in reduced), f"grads never reduced over cp: {reduced}"
    assert all(set(cp_ranks) <= set(r) or r == outer_ranks for r in reduced), f"grads not reduced over cp: {reduced}"


def train_plain_cnn(mesh_shape: Shape, outer: str | None, strategy: str, device: torch.device):
    """Train the plain CNN on ``mesh_shape`` with every engine collective counted; assert parity
    with the reference over the dp ranks' samples; return (mesh, wrapped model, counter)."""
    mesh = seed_mesh(mesh_shape, device.type)
    build = lambda: build_model("cnn", seed=0)  # noqa: E731
    batch = lambda step, n: global_batch("cnn", step, n, torch.float32)  # noqa: E731
    counter = CollectiveCounter()
    losses, final, model = _train(build, batch, loss_fn("cnn"), list(unit_classes("cnn")), mesh, outer,
                                  strategy, split_seq=False, device=device, counter=counter)
    n_samples = mesh["dp"].size() * SAMPLES_PER_DP
    _assert_parity(losses, final, *_reference(build, batch, loss_fn("cnn"), n_samples, device))
    return mesh, model, counter


def check_tp(mesh_shape: Shape, outer: str | None, strategy: str, device: torch.device) -> None:
    """A plain model replicated over ``tp`` trains like the reference and FSDP never talks over tp."""
    mesh, model, counter = train_plain_cnn(mesh_shape, outer, strategy, device)
    tp = model.dist_index.get_tp_group()
    assert tp is not None and group_ranks(tp) == group_ranks(mesh["tp"].get_group())
    assert counter.count(group=tp) == 0, f"FSDP must not communicate over tp: {counter.summary()}"


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
