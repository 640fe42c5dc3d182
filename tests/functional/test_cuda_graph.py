"""CUDA-graph replay trains bit for bit like eager (GPU only; on CPU every case skips naming CUDA).

Each case builds the same model twice from one seed (``GraphNet``: Linear/LayerNorm/GELU units,
deterministic kernels, uneven shards on 2 ranks), both with ``cuda_graph_mode=True``:

- eager: WARMUP steps on the warm-up batch (what ``capture_train_step`` runs before capturing),
  then STEPS steps of ``zero_grad(set_to_none=False)``, forward+loss+backward, ``step()`` on a new
  batch each step;
- replay: ``capture_train_step(..., warmup=WARMUP)``, then STEPS times: copy the step's batch into
  the static inputs, ``replay()`` (scope ``full``: the optimizer step is inside the graph;
  ``fwd_bwd``: ``optimizer.step()`` runs eagerly after the replay).

Checked: per-step losses and every param after STEPS steps are ``torch.equal`` (the same kernels
on the same data; NCCL sums of 2 ranks are order-independent). The batch differs every step, so
this also checks that new data in the static inputs changes the loss exactly as in eager. Per
replay, on every rank: the grads are the same tensors at the same addresses, and non-zero on every
non-empty local shard. Then EXTRA more replays leave ``torch.cuda.memory_allocated()`` unchanged,
and the optimizer's step counter equals warm-ups + replays.

Matrix: ZeRO {1, 2, 3} x {fp32, bf16 compute with fp32 main params} x scope {full, fwd_bwd}, on 1
GPU (plain FSDP) and 2 GPUs (plain FSDP and HSDP over a (dp_outer=2, dp_shard=1) mesh); plus ZeRO-3
with the 2-slot unshard pool, HFSDP, torch SGD, and the ``zero_grad(set_to_none=True)`` regression;
and graph mode's eager path against the normal engine on real streams.
Single-process captures (optimizers alone) run in a fresh 1-rank process each bucket, so a capture
that kills the process fails one test. The h200 L0 tier runs the 2-GPU cases (``-k world2``).
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from fsdp_impl.cuda_graph import CapturedTrainStep, capture_train_step
from fsdp_impl.module import FullyShardedModule
from fsdp_impl.optim import AdamW
from fsdp_impl.unit import attach_unshard_pool
from fsdp_impl.unshard_storage import UnshardStorage
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.graph_training import (
    GraphCase,
    assert_params_equal,
    batch,
    full_params,
    local_grads,
    make_step_fn,
    warmup_then_steps,
    wrap,
)

pytestmark = [pytest.mark.requires_cuda, pytest.mark.matrix(model="graph_net", graph="cuda_graph")]

WARMUP, STEPS, EXTRA = 3, 8, 10
SCOPES = ["full", "fwd_bwd"]
DTYPES = [torch.float32, torch.bfloat16]
PLAIN = [GraphCase(s, None, d) for s in (1, 2, 3) for d in DTYPES]
HSDP = [GraphCase(s, "no_shard", d) for s in (1, 2, 3) for d in DTYPES]


def _ids(case: GraphCase) -> str:
    return case.id


def _cell(world: int, graph: str = "cuda_graph") -> pytest.MarkDecorator:
    """The matrix cell of the ``case`` parametrisation on ``world`` ranks (HSDP: dp_outer = world)."""
    def mesh(case: GraphCase) -> str:
        return axes.mesh(world) if case.outer is None else axes.mesh(1, outer=world)
    return pytest.mark.matrix(mesh=matrix.param("case", mesh), zero=axes.item("case", "strategy", axes.zero),
                              outer=axes.item("case", "outer", axes.outer),
                              dtype=axes.item("case", "dtype", axes.dtype), graph=graph)


def _wrap(case: GraphCase, device: torch.device, pool: bool) -> tuple[FullyShardedModule, torch.optim.Optimizer]:
    model, opt = wrap(case, device, graph_mode=True)
    if pool:  # what fully_shard does for the POOL unshard storage (Megatron's fsdp_double_buffer)
        engine = model._fsdp_engine
        engine.ctx.unshard = UnshardStorage.double_buffer()
        assert attach_unshard_pool(engine.units[:-1], engine.ctx) is not None
    return model, opt


def _eager(case: GraphCase, device: torch.device, pool: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model, opt = _wrap(case, device, pool)
    losses = warmup_then_steps(opt, make_step_fn(model), batch(0, device, case.dtype), WARMUP,
                               [batch(k + 1, device, case.dtype) for k in range(STEPS)])
    return losses, full_params(model)


def _grad_ptrs(model: FullyShardedModule) -> dict[str, tuple[int, int]]:
    return {n: (id(p.grad), p.grad._local_tensor.data_ptr()) for n, p in model.module.named_parameters()}


def _check_grads(model: FullyShardedModule, ptrs: dict[str, tuple[int, int]], when: str) -> None:
    assert _grad_ptrs(model) == ptrs, f"{when}: the grads are not the captured tensors any more"
    zero = [n for n, g in local_grads(model).items() if g.numel() and not g.count_nonzero().item()]
    assert not zero, f"{when}: all-zero grads on a non-empty local shard: {zero}"


def _replay_one(captured: CapturedTrainStep, opt: torch.optim.Optimizer, step: int, dtype: torch.dtype,
                device: torch.device, check: Callable[[], None] | None = None) -> torch.Tensor:
    """Copy step ``step``'s batch in, replay, ``check()`` the grads, and (scope fwd_bwd) step eagerly."""
    captured.copy_inputs(*batch(step, device, dtype))
    loss = captured.replay()
    if check is not None:
        check()
    if not captured.include_optimizer_step:
        opt.step()
    return loss


def _step_count(opt: torch.optim.Optimizer) -> int | None:
    counters = {int(s["step"].item()) for s in opt.state.values() if "step" in s}
    assert len(counters) <= 1, f"optimizer step counters disagree: {counters}"
    return counters.pop() if counters else None


def _replay(case: GraphCase, scope: str, device: torch.device,
            pool: bool) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model, opt = _wrap(case, device, pool)
    static = tuple(t.clone() for t in batch(0, device, case.dtype))
    captured = capture_train_step(model, opt, make_step_fn(model), static, warmup=WARMUP,
                                  include_optimizer_step=scope == "full")
    ptrs = _grad_ptrs(model)
    losses = []
    for k in range(STEPS):
        check = functools.partial(_check_grads, model, ptrs, f"replay {k}")
        losses.append(_replay_one(captured, opt, k + 1, case.dtype, device, check).detach().clone())
    params = full_params(model)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    for k in range(EXTRA):
        _replay_one(captured, opt, 100 + k, case.dtype, device)
    torch.cuda.synchronize(device)
    assert torch.cuda.memory_allocated(device) == before, "replays (and eager steps between them) leaked memory"
    if case.optimizer == "adamw":
        assert _step_count(opt) == WARMUP + STEPS + EXTRA
    return losses, params


def check_replay_matches_eager(case: GraphCase, scope: str, device: torch.device, pool: bool = False) -> None:
    ref_losses, ref_params = _eager(case, device, pool)
    losses, params = _replay(case, scope, device, pool)
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert torch.equal(a, b), f"step {k}: replay loss {a.item()!r} != eager {b.item()!r}"
    assert len({float(x) for x in losses}) > 1, "the losses never changed: the data or the step did not reach the graph"
    assert_params_equal(params, ref_params, "replay vs eager after the replayed steps")


# ------------------------------------------------------------------------------------------ 1 GPU
@pytest.mark.distributed(world_size=1, timeout=600)
@_cell(1)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("case", PLAIN, ids=_ids)
def test_replay_matches_eager_world1(case: GraphCase, scope: str, dist_env) -> None:
    check_replay_matches_eager(case, scope, dist_env.device)


@pytest.mark.distributed(world_size=1, timeout=600)
@_cell(1)
@pytest.mark.parametrize("case,scope,pool", [
    (GraphCase(3), "full", True), (GraphCase(3, dtype=torch.bfloat16), "fwd_bwd", True),
    (GraphCase(1, optimizer="sgd"), "full", False), (GraphCase(3, optimizer="sgd"), "fwd_bwd", False),
], ids=["pool-full", "pool-bf16-fwd_bwd", "sgd-zero1", "sgd-zero3-fwd_bwd"])
def test_replay_variants_world1(case: GraphCase, scope: str, pool: bool, dist_env) -> None:
    """ZeRO-3 on the 2-slot unshard pool; torch SGD (momentum buffers made by the warm-up)."""
    check_replay_matches_eager(case, scope, dist_env.device, pool)


@pytest.mark.regression("graph-zero-grad-set-to-none-drops-grad-views",
                        description="zero_grad(set_to_none=True) dropped the .grad views of the gradient "
                                    "buffer that a captured CUDA graph writes into: replays silently "
                                    "stopped delivering gradients")
@pytest.mark.distributed(world_size=1, timeout=600)
@pytest.mark.matrix(mesh=axes.mesh(1), zero="optim_grads_params", dtype="fp32")
def test_zero_grad_set_to_none_cannot_break_replay_world1(dist_env) -> None:
    """Before the fix, ``optimizer.zero_grad()`` (set_to_none=True, torch's default) after capture
    freed the grad buffer and set ``.grad`` to None: the replays then wrote into memory nobody read
    and the optimizer saw no grads. Now it raises and the replays keep training."""
    device = dist_env.device
    model, opt = _wrap(GraphCase(3), device, pool=False)
    static = tuple(t.clone() for t in batch(0, device, torch.float32))
    captured = capture_train_step(model, opt, make_step_fn(model), static, warmup=WARMUP)
    ptrs = _grad_ptrs(model)
    with pytest.raises(ValueError, match=r"zero_grad\(set_to_none=True\) is not allowed with cuda_graph_mode=True"):
        opt.zero_grad()
    with pytest.raises(ValueError, match=r"set_to_none=False"):
        model.zero_grad(set_to_none=True)
    before = full_params(model)
    for k in range(3):
        _replay_one(captured, opt, k + 1, torch.float32, device,
                    functools.partial(_check_grads, model, ptrs, f"replay {k} after the refused zero_grad"))
    assert _step_count(opt) == WARMUP + 3
    moved = [n for n, p in full_params(model).items() if not torch.equal(p, before[n])]
    assert len(moved) == len(before), f"params the replays did not update: {sorted(set(before) - set(moved))}"


# ------------------------------------------------------------------------------------------ 2 GPUs
@pytest.mark.distributed(world_size=2, timeout=600)
@_cell(2)
@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("case", PLAIN + HSDP, ids=_ids)
def test_replay_matches_eager_world2(case: GraphCase, scope: str, dist_env) -> None:
    check_replay_matches_eager(case, scope, dist_env.device)


@pytest.mark.distributed(world_size=2, timeout=600)
@_cell(2)
@pytest.mark.parametrize("case,scope,pool", [
    (GraphCase(3, "optim"), "full", False), (GraphCase(3, "optim", torch.bfloat16), "fwd_bwd", False),
    (GraphCase(3), "full", True), (GraphCase(3, "no_shard"), "fwd_bwd", True),
    (GraphCase(3, optimizer="sgd"), "full", False),
], ids=["hfsdp-full", "hfsdp-bf16-fwd_bwd", "pool-full", "pool-hsdp-fwd_bwd", "sgd-zero3"])
def test_replay_variants_world2(case: GraphCase, scope: str, pool: bool, dist_env) -> None:
    """HFSDP (outer 'optim': two-level grad reduction), the unshard pool, torch SGD."""
    check_replay_matches_eager(case, scope, dist_env.device, pool)


@pytest.mark.distributed(world_size=2, timeout=600)
@_cell(2, graph="eager")  # graph mode's eager path (no capture) against the normal engine
@pytest.mark.parametrize("case", [GraphCase(1), GraphCase(2, "no_shard"), GraphCase(3),
                                  GraphCase(3, dtype=torch.bfloat16)], ids=_ids)
def test_graph_mode_eager_matches_normal_mode_world2(case: GraphCase, dist_env) -> None:
    """Graph mode's eager path (persistent buffers, no record_stream, refresh every forward) trains
    like the normal engine on real streams: a cross-stream reuse race would show here."""
    device = dist_env.device
    results = []
    for graph_mode in (False, True):
        model, opt = wrap(case, device, graph_mode=graph_mode)
        step_fn = make_step_fn(model)
        losses = []
        for k in range(STEPS):
            opt.zero_grad(set_to_none=False)
            losses.append(step_fn(*batch(k, device, case.dtype)).detach().clone())
            opt.step()
        results.append((losses, full_params(model)))
    (ref_losses, ref_params), (losses, params) = results
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)), (losses, ref_losses)
    assert_params_equal(params, ref_params, "graph-mode eager vs normal eager")


# ------------------------------------------------------------------ single process (one fresh rank)
# These need no process group, but run as 1-rank distributed tests: a fresh rank process starts
# with CUDA untouched whatever the pytest process did (a forked child inherits its CUDA state).


def _optimizer_replay_matches_eager(make_opt, device: torch.device,
                                    steps: int = 6) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """``make_opt(params)`` stepped eagerly vs one warm-up step then a captured step replayed:
    new grads are copied into the same ``.grad`` tensors before every step."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in [(33, 7), (5,), (0,)]]
    grads = [[torch.randn(t.shape, generator=gen).to(device) for t in start] for _ in range(steps)]
    eager_p = [torch.nn.Parameter(t.to(device)) for t in start]
    graph_p = [torch.nn.Parameter(t.to(device)) for t in start]
    for p in eager_p + graph_p:
        p.grad = torch.zeros_like(p)
    eager, graphed = make_opt(eager_p), make_opt(graph_p)
    for g in grads:
        for p, gi in zip(eager_p, g, strict=True):
            p.grad.copy_(gi)
        eager.step()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # the warm-up step creates the state outside the capture
        for p, gi in zip(graph_p, grads[0], strict=True):
            p.grad.copy_(gi)
        graphed.step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed.step()
    for g in grads[1:]:
        for p, gi in zip(graph_p, g, strict=True):
            p.grad.copy_(gi)
        graph.replay()
    torch.cuda.synchronize(device)
    for i, (a, b) in enumerate(zip(graph_p, eager_p, strict=True)):
        assert torch.equal(a.detach(), b.detach()), f"param {i}: replay differs from eager"
    return eager, graphed


@pytest.mark.distributed(world_size=1, timeout=300)
@pytest.mark.matrix(model="optimizer_only", dtype="fp32")
@pytest.mark.parametrize("kwargs", [{}, {"amsgrad": True, "exp_avg_dtype": torch.bfloat16}],
                         ids=["fp32", "amsgrad-bf16-moments"])
def test_capturable_adamw_replay_is_bitwise_eager(kwargs, dist_env) -> None:
    eager, graphed = _optimizer_replay_matches_eager(lambda ps: AdamW(ps, lr=1e-2, capturable=True, **kwargs),
                                                     dist_env.device)
    assert _step_count(graphed) == _step_count(eager) == 6


@pytest.mark.distributed(world_size=1, timeout=300)
@pytest.mark.matrix(model="optimizer_only", dtype="fp32")
def test_sgd_momentum_replay_is_bitwise_eager(dist_env) -> None:
    """torch SGD has no step counter and no host sync; its momentum buffers are made by the
    warm-up step, so the captured step is its steady-state update."""
    _optimizer_replay_matches_eager(lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, weight_decay=1e-3),
                                    dist_env.device)
