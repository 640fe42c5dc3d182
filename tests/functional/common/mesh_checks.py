"""The mesh-shape checks (HSDP, HFSDP, CP, TP-plain, plain FSDP) of ``test_mesh_hsdp.py`` and
``test_mesh_tp_cp.py``, taking the mesh shape and the device, so ``test_mesh_world2.py`` runs the
same checks on 2-rank meshes (2 GPUs under NCCL).

Every check trains 3 steps of 2 accumulation microbatches (no sync, then sync) with SGD (momentum;
scale-sensitive, so a wrong average across any dim shows) and compares per-step losses and final
params with a single-process reference on the union of the samples of the ranks that average
grads together, at 1e-5 relative (fp32; measured <= 1e-6: only the order of sums differs). A
``CollectiveCounter`` checks which group each collective of the engine runs on.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl import fully_shard

from .collective_counter import CollectiveCounter, group_ranks
from .mesh import assert_same_on_all_ranks, data_position, full_params, seed_kwargs, seed_mesh
from .models import ResidualMLP, build_model, loss_fn, unit_classes
from .numerics import assert_losses_close, max_relative_error
from .reference import global_batch, make_optimizer
from .training import Microbatch, train_accumulating

RTOL = 1e-5
STEPS, MICRO = 3, 2
Shape = tuple[int, int, int, int]  # (dp_outer, dp_shard, cp, tp)
Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]


def assert_parity(losses: list[float], final: dict[str, torch.Tensor], ref_losses: list[float],
                  ref_params: dict[str, torch.Tensor]) -> None:
    """Per-step losses and every final param within ``RTOL`` (relative)."""
    assert_losses_close(losses, ref_losses, RTOL)
    err, where = max_relative_error(final, ref_params)
    assert err <= RTOL, f"param {where}: relative error {err:.3g} > {RTOL}"


def train_reference(build: Callable[[], nn.Module], batch: Callable[[int, int], Batch], loss: Callable,
                    n: int, device: torch.device, opt_kind: str = "sgd") -> tuple[list[float], dict]:
    """Full-batch training of ``n`` samples on ``device`` (like kernels with like); params
    returned on the CPU."""
    model = build().to(device)
    opt = make_optimizer(opt_kind, model.named_parameters())
    losses = []
    for step in range(STEPS):
        inputs, target = batch(step, n)
        value = loss(model(*[x.to(device) for x in inputs]), target.to(device))
        value.backward()
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    return losses, {k: v.detach().cpu().clone() for k, v in model.named_parameters()}


# ----- HSDP / HFSDP -------------------------------------------------------------------------

HSDP_LOCAL = 4  # samples per rank and step (MICRO microbatches of 2)


def hsdp_wrap(name: str, strategy: object, outer: str, device: torch.device, shape: Shape,
              opt_kind: str = "sgd"):
    """(mesh, wrapped model, optimizer) for model ``name`` under outer strategy ``outer``."""
    mesh = seed_mesh(shape, device.type)
    model = build_model(name, seed=0)
    opt = make_optimizer(opt_kind, model.named_parameters())
    fsdp_model, opt = fully_shard(model, opt, fsdp_unit_modules=list(unit_classes(name)),
                                  zero_dp_strategy=strategy, **seed_kwargs(mesh, outer))
    return mesh, fsdp_model, opt


def _cnn_batch(name: str) -> Callable[[int, int], Batch]:
    return lambda step, n: global_batch(name, step, n, torch.float32)


def hsdp_train(name: str, fsdp_model, opt, mesh, device: torch.device,
               counters: list[CollectiveCounter] | None = None) -> list[float]:
    """3 steps x 2 microbatches on this rank's slice (by its position in the hybrid group); with
    ``counters``, microbatch m's collectives are recorded in ``counters[m]`` (first step only)."""
    pos, n = data_position(mesh["hsdp"].get_group())
    per = HSDP_LOCAL // MICRO

    def microbatches(step: int) -> list[Microbatch]:
        inputs, target = global_batch(name, step, n * HSDP_LOCAL, torch.float32)
        spans = [slice(pos * HSDP_LOCAL + m * per, pos * HSDP_LOCAL + (m + 1) * per) for m in range(MICRO)]
        return [([x[s].to(device) for x in inputs], target[s].to(device)) for s in spans]

    def record(step: int, m: int) -> CollectiveCounter | None:
        return counters[m] if counters is not None and step == 0 else None

    return train_accumulating(fsdp_model, opt, STEPS, microbatches, loss_fn(name), device, record)


def hsdp_reference(name: str, device: torch.device, opt_kind: str = "sgd") -> tuple[list[float], dict]:
    """The reference on all ranks' samples."""
    return train_reference(lambda: build_model(name, seed=0), _cnn_batch(name), loss_fn(name),
                           dist.get_world_size() * HSDP_LOCAL, device, opt_kind)


def check_hsdp(name: str, strategy: str, device: torch.device, shape: Shape) -> None:
    """HSDP (outer no_shard) on ``shape``: parity, and outer traffic only on the sync microbatch."""
    mesh, model, opt = hsdp_wrap(name, strategy, "no_shard", device, shape)
    counters = [CollectiveCounter(), CollectiveCounter()]
    losses = hsdp_train(name, model, opt, mesh, device, counters)
    assert_parity(losses, full_params(model), *hsdp_reference(name, device))

    outer, inner = mesh["dp_outer"].get_group(), mesh["dp_shard"].get_group()
    units = [u for u in model._fsdp_engine.units if u.grad is not None]
    no_sync, sync = counters
    assert no_sync.count("all_reduce", outer) == 0, f"outer traffic before the sync microbatch: {no_sync.summary()}"
    assert sync.count("all_reduce", outer) == len(units), f"want one outer all-reduce per unit: {sync.summary()}"
    for c in counters:  # everything else stays inside dp_shard
        bad = [k for k in c.calls if k[1] not in (group_ranks(inner), group_ranks(outer))]
        assert not bad, f"collectives on unexpected groups: {bad}"
        assert c.count("all_reduce", outer) == c.count(ranks=group_ranks(outer)), c.summary()
    # A one-rank dp_shard group moves nothing: the engine runs its gathers and reduce-scatters as
    # local copies (comm.solo), so none may reach the process group.
    solo = inner.size() == 1
    if strategy in ("optim_grads", "optim_grads_params"):
        got = no_sync.count("reduce_scatter_tensor", inner)
        assert got == (0 if solo else len(units)), f"reduce-scatters on dp_shard: {no_sync.summary()}"
    if strategy == "optim_grads_params":
        got = no_sync.count("all_gather_into_tensor", inner)
        assert got == 0 if solo else got >= len(model._fsdp_engine.units), f"all-gathers: {no_sync.summary()}"
    idx = model.dist_index
    assert group_ranks(idx.get_fsdp_group()) == group_ranks(inner)
    assert group_ranks(idx.get_outer_fsdp_group()) == group_ranks(outer)
    assert idx.get_hybrid_fsdp_group() is mesh["hsdp"].get_group() and idx.get_tp_group() is None


def _assert_sharded_over(model, opt, ways: int) -> None:
    """Main params (hence optimizer state) are sharded ``ways`` ways (torch.chunk rows)."""
    for n, p in model.module.named_parameters():
        rows = p.shape[0]
        assert p.to_local().shape[0] <= -(-rows // ways), f"{n}: local rows {p.to_local().shape[0]} of {rows}"
        assert p.device_mesh.size() == ways
    for state in opt.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:
                local = v.to_local() if hasattr(v, "to_local") else v
                row_numel = math.prod(v.shape[1:])
                assert local.numel() <= -(-v.shape[0] // ways) * row_numel, f"optimizer state not sharded {ways} ways"


def check_hfsdp(name: str, device: torch.device, shape: Shape) -> None:
    """HFSDP (outer optim, inner 3) on ``shape``: parity; params gathered over the hybrid group,
    grads reduced in two levels (dp_outer only on the sync microbatch); main params and
    optimizer state sharded over all of it."""
    mesh, model, opt = hsdp_wrap(name, "optim_grads_params", "optim", device, shape)
    counters = [CollectiveCounter(), CollectiveCounter()]
    losses = hsdp_train(name, model, opt, mesh, device, counters)
    assert_parity(losses, full_params(model), *hsdp_reference(name, device))

    hybrid = group_ranks(mesh["hsdp"].get_group())
    inner = group_ranks(model.dist_index.get_fsdp_group())
    outer = group_ranks(mesh["dp_outer"].get_group())
    rs = "reduce_scatter_tensor"
    for c in counters:  # params: gathered over the whole hybrid group on every microbatch
        assert c.count("all_gather_into_tensor") == c.count("all_gather_into_tensor", ranks=hybrid) > 0
        assert c.count("all_reduce", mesh["dp_outer"].get_group()) == 0, c.summary()
    # grads: reduce-scattered inside dp_shard every microbatch (no collective for a 1-rank
    # dp_shard), across dp_outer once per unit on the sync microbatch only
    no_sync, sync = counters
    assert no_sync.count(rs, ranks=outer) == 0, no_sync.summary()
    assert sync.count(rs, ranks=outer) > 0, sync.summary()
    per_unit = sync.count(rs, ranks=outer)
    inner_calls = per_unit if len(inner) > 1 else 0
    assert no_sync.count(rs) == no_sync.count(rs, ranks=inner) == inner_calls, no_sync.summary()
    assert sync.count(rs) == inner_calls + per_unit and sync.count(rs, ranks=inner) == inner_calls, sync.summary()
    _assert_sharded_over(model, opt, len(hybrid))
    assert group_ranks(model.dist_index.get_fsdp_group()) == group_ranks(mesh["dp_shard"].get_group())


# ----- CP / TP ------------------------------------------------------------------------------

SAMPLES_PER_DP, SEQ, D = 2, 4, 4


class TokenBlock(ResidualMLP):
    """Residual per-token MLP: position i's output depends only on position i."""

    def __init__(self, d: int = D, hidden: int = 8) -> None:
        super().__init__(d, hidden, act="tanh")


class TokenModel(nn.Module):
    """Per-token blocks and head: a sequence can be split across cp ranks without changing it."""

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


def _train_on_mesh(build, batch, loss, units, mesh, outer: str | None, strategy, split_seq: bool,
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


def check_cp(mesh_shape: Shape, outer: str | None, strategy: str, device: torch.device) -> None:
    """Sequence chunks over ``cp`` (dp_shard_dim = the flattened dp_shard x cp dim) train like
    full sequences, and grads are reduced over groups that contain the cp ranks."""
    mesh = seed_mesh(mesh_shape, device.type)
    counter = CollectiveCounter()
    losses, final, model = _train_on_mesh(_token_model, _token_batch, _mse, [TokenBlock], mesh, outer, strategy,
                                          split_seq=True, device=device, counter=counter)
    n_samples = mesh["dp"].size() * SAMPLES_PER_DP
    assert_parity(losses, final, *train_reference(_token_model, _token_batch, _mse, n_samples, device))
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
    counter = CollectiveCounter()
    losses, final, model = _train_on_mesh(build, _cnn_batch("cnn"), loss_fn("cnn"), list(unit_classes("cnn")),
                                          mesh, outer, strategy, split_seq=False, device=device, counter=counter)
    n_samples = mesh["dp"].size() * SAMPLES_PER_DP
    assert_parity(losses, final, *train_reference(build, _cnn_batch("cnn"), loss_fn("cnn"), n_samples, device))
    return mesh, model, counter


def check_tp(mesh_shape: Shape, outer: str | None, strategy: str, device: torch.device) -> None:
    """A plain model replicated over ``tp`` trains like the reference and FSDP never talks over tp."""
    mesh, model, counter = train_plain_cnn(mesh_shape, outer, strategy, device)
    tp = model.dist_index.get_tp_group()
    assert tp is not None and group_ranks(tp) == group_ranks(mesh["tp"].get_group())
    assert counter.count(group=tp) == 0, f"FSDP must not communicate over tp: {counter.summary()}"
