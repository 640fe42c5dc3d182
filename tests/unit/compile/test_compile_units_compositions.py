"""``compile_units`` composed with decoupled grads, and FP8 units that stop recompiling after the
first step (CPU/gloo, 2 ranks).

Decoupled grads: the engine writes each main grad to ``param.decoupled_grad`` (here bf16 main
grads of fp32 main params, the case the switch exists for) and ``fsdp_impl.optim.AdamW(
use_decoupled_grad=True)`` reads it; the compiled forward changes nothing of that path, so with
``aot_eager`` the losses and trained params equal the eager run's bit for bit, and every unit ran
its compiled graph. FP8: ``fp8_gemm`` counted its backend in a global ``Counter`` that Dynamo
traced and guarded on, so each call failed the last guard and recompiled, toward the recompile
limit, with the compile inside every step; after the first step no graph may be compiled, and the
count (skipped while Dynamo traces) breaks no graph.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdp_impl
from fsdp_impl.module import FullyShardedModule
from tests.functional.common import fp8_training as fp8
from tests.functional.common.graph_training import (
    Block,
    GraphNet,
    assert_params_equal,
    eager_steps,
    full_params,
)
from tests.unit.compile.compile_checks import AOT, CPU, STEPS, assert_compiled

pytestmark = pytest.mark.distributed(world_size=2, timeout=600)


def _decoupled(strategy: int, grads_dtype: torch.dtype, compile_units: dict | None
               ) -> tuple[list[float], FullyShardedModule]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = GraphNet()
    opt = fsdp_impl.optim.AdamW(module.parameters(), lr=1e-2, use_decoupled_grad=True)
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=grads_dtype)
    model, opt = fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                       mixed_precision_policy=policy, use_decoupled_grad=True,
                                       compile_units=compile_units)
    losses = [x.item() for x in eager_steps(model, opt, range(STEPS), CPU, torch.float32)]
    return losses, model


@pytest.mark.parametrize(("strategy", "grads_dtype"), [(3, torch.bfloat16), (2, torch.float32)],
                         ids=["zero3-bf16-grads", "zero2-fp32-grads"])
def test_decoupled_grads_bit_for_bit(strategy: int, grads_dtype: torch.dtype, dist_env) -> None:
    want, ref = _decoupled(strategy, grads_dtype, None)
    got, model = _decoupled(strategy, grads_dtype, AOT)
    assert got == want
    assert want[-1] < want[0], want  # it trained: the optimizer saw the decoupled grads
    assert_params_equal(full_params(model), full_params(ref), "decoupled grads, compiled vs eager")
    assert_compiled(model.compile_stats, units=3)
    for p in model.parameters():  # the grads went where the optimizer reads them, not to .grad
        assert p.grad is None


@pytest.mark.slow  # ~14 s, like the other FP8 compile tests (test_compile_units.py)
def test_fp8_units_compile_once(dist_env) -> None:
    """``Float8Linear`` units (current scaling, FP8 params, ZeRO-3): every graph is compiled in the
    first step; later steps call the same graphs (before the fix: 8 graphs more per step here)."""
    torch._dynamo.reset()
    model, opt = fp8.wrap(fp8.build("current"), 3, compile_units={**AOT, "fullgraph": True})
    fp8.train_fsdp(model, opt, dist.get_rank(), 1, 2, CPU)
    stats = model.compile_stats
    graphs, calls = stats.graphs_compiled, stats.compiled_calls
    fp8.train_fsdp(model, opt, dist.get_rank(), 3, 2, CPU, first=1)
    assert stats.graphs_compiled == graphs, f"{stats.graphs_compiled - graphs} graphs compiled after the first step"
    assert stats.compiled_calls == 4 * calls, (stats.compiled_calls, calls)  # the same graphs every step
    assert stats.graph_breaks == 0 and all(u.compiled_calls == u.calls for u in stats.units.values()), stats
