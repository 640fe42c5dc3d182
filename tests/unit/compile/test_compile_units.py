"""``fully_shard(..., compile_units=)`` on CPU/gloo, 2 ranks: each unit's forward compiled, the
engine's hooks eager around it.

Reference: the same model, seed, data and optimizer wrapped without ``compile_units``. With
``backend="aot_eager"`` (AOTAutograd, then the captured aten graphs run as they are: no fusion,
no reordering, no decompositions that change the arithmetic) the compiled run must equal it bit
for bit: losses, and the trained params. One inductor case checks a stated tolerance instead.
Every compiled case asserts from ``model.compile_stats`` that each unit's forward called
compiled graphs (compiled_calls == calls x graphs per call) and the graph-break count, so a
silent eager fallback fails. Dynamo is reset at the start of each test, so the compile counts
do not depend on the test order.
"""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_impl
from fsdp_impl._testing import GRAPH_MODE_ON_CPU
from fsdp_impl.cuda_graph import capture_train_step
from fsdp_impl.module import FullyShardedModule
from tests.functional.common import fp8_training as fp8
from tests.functional.common import recompute as rc
from tests.functional.common.graph_training import (
    Block,
    GraphCase,
    GraphNet,
    assert_params_equal,
    eager_steps,
    full_params,
    make_step_fn,
    warmup_then_steps,
    wrap,
)
from tests.unit.compile.compile_checks import AOT, CPU, STEPS, assert_compiled

pytestmark = pytest.mark.distributed(world_size=2, timeout=600)



def run_pair(case: GraphCase, graph_mode: bool = False, compile_units: dict | bool = True, **kwargs):
    """The same case eager and compiled: (eager losses, compiled losses, eager model, compiled model)."""
    torch._dynamo.reset()
    ctx = GRAPH_MODE_ON_CPU.on() if graph_mode else None
    if ctx is not None:
        ctx.__enter__()
    try:
        ref, ref_opt = wrap(case, CPU, graph_mode=graph_mode, **kwargs)
        model, opt = wrap(case, CPU, graph_mode=graph_mode, compile_units=compile_units, **kwargs)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    want = eager_steps(ref, ref_opt, range(STEPS), CPU, case.dtype)
    got = eager_steps(model, opt, range(STEPS), CPU, case.dtype)
    return want, got, ref, model


@pytest.mark.parametrize("case", [GraphCase(0), GraphCase(1), GraphCase(2), GraphCase(3),
                                  GraphCase(3, outer="no_shard")], ids=lambda c: c.id)
def test_zero_strategies_bit_for_bit(case: GraphCase, dist_env) -> None:
    want, got, ref, model = run_pair(case, compile_units=AOT)
    assert [x.item() for x in got] == [x.item() for x in want]
    assert_params_equal(full_params(model), full_params(ref), f"{case.id} compiled vs eager")
    assert_compiled(model.compile_stats, units=3)


@pytest.mark.parametrize("strategy", [2, 3])
def test_mixed_precision_bf16_compute_bit_for_bit(strategy: int, dist_env) -> None:
    """bf16 compute params, fp32 main params and grads (GraphCase's policy)."""
    case = GraphCase(strategy, dtype=torch.bfloat16)
    want, got, ref, model = run_pair(case, compile_units=AOT)
    assert [x.item() for x in got] == [x.item() for x in want]
    assert_params_equal(full_params(model), full_params(ref), f"{case.id} compiled vs eager")
    assert_compiled(model.compile_stats, units=3)


def test_graph_mode_bookkeeping_bit_for_bit(dist_env) -> None:
    """CUDA-graph mode's bookkeeping (persistent buffers, fixed addresses) run eagerly on CPU with
    compiled units: the part of ``capture_train_step`` that runs without CUDA."""
    case = GraphCase(3)
    want, got, ref, model = run_pair(case, graph_mode=True, compile_units=AOT)
    assert [x.item() for x in got] == [x.item() for x in want]
    assert_params_equal(full_params(model), full_params(ref), "graph mode compiled vs eager")
    assert_compiled(model.compile_stats, units=3)


@pytest.mark.requires_cuda  # capture_train_step needs CUDA (torch.cuda.graph) and an NCCL mesh
@pytest.mark.distributed(world_size=1, timeout=600)  # one GPU: the module's two ranks would be gloo ranks
def test_capture_train_step_with_compiled_units(dist_env) -> None:  # pragma: no cover - GPU only
    """Compiled units (aot_eager) inside a captured step: the replays' losses equal the eager
    model's bit for bit, and the units' forwards ran compiled graphs."""
    device = dist_env.device
    case = GraphCase(3)
    torch._dynamo.reset()
    ref, ref_opt = wrap(case, device, graph_mode=True)
    model, opt = wrap(case, device, graph_mode=True, compile_units=AOT)
    from tests.functional.common.graph_training import batch
    warm = batch(0, device, case.dtype)
    captured = capture_train_step(model, opt, make_step_fn(model), tuple(t.clone() for t in warm), warmup=3)
    got = []
    for step in range(1, 4):
        captured.copy_inputs(*batch(step, device, case.dtype))
        got.append(captured.replay().clone())
    # the eager twin: the capture's 3 warm-up steps on its static batch, then one step per batch
    want = warmup_then_steps(ref_opt, make_step_fn(ref), warm, 3, [batch(k, device, case.dtype) for k in range(1, 4)])
    assert [x.item() for x in got] == [x.item() for x in want]
    assert_params_equal(full_params(model), full_params(ref), "captured compiled units vs eager")
    assert_compiled(model.compile_stats, units=3)


def _recompute_run(style: str, compile_units: dict | None) -> tuple[rc.RunRecord, FullyShardedModule]:
    torch._dynamo.reset()
    net = rc.build_net(style)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[rc.RecomputeBlock], zero_dp_strategy=3,
                                       compile_units=compile_units)
    if style == "wrapper_after":
        rc.wrap_blocks(model)
    return rc.train(model, opt, STEPS, 2, CPU), model


@pytest.mark.parametrize("style", [pytest.param(s, marks=() if s == "inside" else pytest.mark.slow)
                                   for s in rc.STYLES if s != "none"])
def test_activation_recompute_bit_for_bit(style: str, dist_env) -> None:
    """Every recompute style the engine supports, ZeRO-3, compiled vs the same style eager."""
    want, _ = _recompute_run(style, None)
    got, model = _recompute_run(style, AOT)
    rc.assert_bit_identical(got, want, f"{style}: compiled units vs eager")
    # no graph break in any style (torch 2.13): Dynamo traces both checkpoint kinds inside the forward
    assert_compiled(model.compile_stats, units=4)


def test_checkpoint_wrapper_as_the_unit_compiles_the_recompute(dist_env) -> None:
    """A unit inside a ``checkpoint_wrapper`` warns (its recompute calls the compiled forward a
    second time, from eager code); the wrapper as the unit does not warn, runs one compiled call
    per forward (the checkpoint traced with the block, the recompute inside the compiled backward)
    and equals the eager run of the same style bit for bit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    want, _ = _recompute_run("wrapper", None)
    with pytest.warns(UserWarning, match=r"4 unit\(s\) sit inside a checkpoint_wrapper"):
        _, inside = _recompute_run("wrapper", AOT)
    assert all(u.calls == 2 * STEPS for u in inside.compile_stats.units.values()), inside.compile_stats
    torch._dynamo.reset()
    net = rc.build_net("wrapper")
    model, opt = fsdp_impl.fully_shard(net, torch.optim.Adam(net.parameters(), lr=1e-2),
                                       fsdp_unit_modules=[CheckpointWrapper], zero_dp_strategy=3, compile_units=AOT)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = rc.train(model, opt, STEPS, 2, CPU)
    assert not [w for w in seen if "checkpoint_wrapper" in str(w.message)], [str(w.message) for w in seen]
    rc.assert_bit_identical(got, want, "checkpoint_wrapper as the compiled unit vs eager")
    assert_compiled(model.compile_stats, units=4)
    assert all(u.calls == STEPS for u in model.compile_stats.units.values()), model.compile_stats


def test_fine_grained_param_gather_breaks_the_graph_per_submodule_and_stays_exact(dist_env) -> None:
    """``enable_fine_grained_param_gather`` hooks every submodule holding params inside the unit's
    compiled forward: with fullgraph=False Dynamo breaks the graph there and the run equals eager
    bit for bit (fullgraph=True is refused before the wrap: test_compile_units_args.py)."""
    want, got, ref, model = run_pair(GraphCase(3), compile_units={**AOT, "fullgraph": False},
                                     enable_fine_grained_param_gather=True)
    assert [x.item() for x in got] == [x.item() for x in want]
    assert_params_equal(full_params(model), full_params(ref), "fine-grained gather, compiled vs eager")
    stats = model.compile_stats
    assert stats.graph_breaks > 0, "the submodule hooks inside the compiled forward must break the graph"
    # a graph on each side of a break (torch 2.11 counts the break at every call, 2.13 once per trace)
    assert len(stats.units) == 3 and all(u.compiled_calls >= 2 * u.calls > 0 for u in stats.units.values()), stats


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [2, 3])
def test_torch_native_fp8_bit_for_bit(strategy: int, dist_env) -> None:
    """``Float8Linear`` with FP8 params (current scaling, emulated on CPU), bf16 compute, fp32 main."""
    def run(compile_units: dict | None) -> tuple[list[float], dict[str, torch.Tensor], FullyShardedModule]:
        torch._dynamo.reset()
        model, opt = fp8.wrap(fp8.build("current"), strategy, compile_units=compile_units)
        losses = fp8.train_fsdp(model, opt, dist.get_rank(), STEPS, 2, CPU)
        return losses, fp8.full_params(model), model
    want, want_params, _ = run(None)
    # fullgraph and Dynamo's default recompile limit: fp8_gemm's backend count is skipped while
    # Dynamo traces (it was a torch.compiler.disable'd call that broke the graph at every GEMM, 9
    # breaks here, and its nested frames needed a recompile limit above the default 8)
    got, got_params, model = run({**AOT, "fullgraph": True})
    assert got == want
    assert_params_equal(got_params, want_params, "fp8 compiled vs eager")
    assert_compiled(model.compile_stats, units=2, breaks=0)


def test_recompile_limit_is_an_error(dist_env) -> None:
    """Past the recompile limit Dynamo would run the unit eagerly with only a log warning."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = GraphNet()
    model, _ = fsdp_impl.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1), fsdp_unit_modules=[Block],
                                     compile_units={"backend": "aot_eager", "dynamic": False})
    with torch._dynamo.config.patch(recompile_limit=1):
        model(torch.randn(4, 12))
        with pytest.raises(RuntimeError, match=r"compile_units: unit 'blocks.0' hit Dynamo's recompile limit "
                                               r"\(torch._dynamo.config.recompile_limit = 1\)"):
            model(torch.randn(5, 12))  # a new batch size with dynamic=False: a second entry


class BreakingBlock(Block):
    """``Block`` with a Dynamo graph break in the middle of its forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        torch._dynamo.graph_break()
        return x + F.gelu(self.norm(h))


def test_graph_breaks_are_counted(dist_env) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(12, 32), BreakingBlock(32), BreakingBlock(32))
    model, opt = fsdp_impl.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                       fsdp_unit_modules=[BreakingBlock], compile_units=AOT)
    torch.manual_seed(0)
    ref_net = nn.Sequential(nn.Linear(12, 32), BreakingBlock(32), BreakingBlock(32))
    ref, ref_opt = fsdp_impl.fully_shard(ref_net, torch.optim.SGD(ref_net.parameters(), lr=0.1),
                                         fsdp_unit_modules=[BreakingBlock])
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(dist.get_rank()))
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    assert torch.equal(model(x), ref(x))
    assert_compiled(model.compile_stats, units=2, breaks=1)
    assert "graph_break" in model.compile_stats.units["1"].break_reasons[0]


def test_root_only_model_compiles_the_root(dist_env) -> None:
    """No ``fsdp_unit_modules``: the root unit's module (no engine hook inside it) is compiled."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    net = GraphNet()
    model, _ = fsdp_impl.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1), compile_units=AOT)
    torch.manual_seed(0)
    ref_net = GraphNet()
    ref, _ = fsdp_impl.fully_shard(ref_net, torch.optim.SGD(ref_net.parameters(), lr=0.1))
    x = torch.randn(4, 12)
    assert torch.equal(model(x), ref(x))
    assert list(model.compile_stats.units) == [""]
    assert_compiled(model.compile_stats, units=1)


def test_no_compiled_graph_is_an_error(dist_env) -> None:
    """Dynamo disabled: the units run eagerly, which the first forward reports, naming the cause."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(disable=True):
        torch.manual_seed(0)
        net = GraphNet()
        model, _ = fsdp_impl.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                         fsdp_unit_modules=[Block], compile_units=AOT)
        with pytest.raises(RuntimeError, match=r"compile_units: unit 'blocks.0' ran 1 forward call\(s\) and no "
                                               r"compiled graph .* cause: Dynamo is disabled"):
            model(torch.randn(4, 12))
    assert model.compile_stats.compiled_calls == 0


def test_hand_compiled_unit_is_refused(dist_env) -> None:
    net = GraphNet()
    block = net.blocks[1]
    block.forward = torch.compile(type(block).forward.__get__(block), backend="aot_eager")
    with pytest.raises(ValueError, match=r"compile_units: unit 'blocks.1' \(Block\) already has its own instance "
                                         r"forward"):
        fsdp_impl.fully_shard(net, torch.optim.SGD(net.parameters(), lr=0.1), fsdp_unit_modules=[Block],
                              compile_units=AOT)


@pytest.mark.slow
def test_inductor_within_tolerance(dist_env) -> None:
    """Inductor (C++ on CPU) fuses LayerNorm, GELU and the residual add into generated kernels whose
    fp32 reductions and FMAs round differently from ATen's: the losses are not bit-equal (measured:
    step 3's loss off by 6e-8 relative, 1 ulp-level). rtol 1e-5 is ~100x that over 3 AdamW steps;
    a wrong unit (stale or missing params, a skipped hook) changes the loss at the 1e-2 level."""
    want, got, _, model = run_pair(GraphCase(3), compile_units={"backend": "inductor"})
    torch.testing.assert_close(torch.stack(got), torch.stack(want), rtol=1e-5, atol=0)
    assert_compiled(model.compile_stats, units=3)
