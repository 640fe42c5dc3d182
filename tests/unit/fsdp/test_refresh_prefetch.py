"""ZeRO-1/2 refresh gathers are prefetched like ZeRO-3's unshard gathers: after an optimizer step
the all-gather of the next unit's main shards starts while the unit before it runs (in its
pre-forward), and training is bit-identical to the same model without prefetch
(``overlap_param_gather=False``), in normal and in CUDA-graph mode (run eagerly on CPU/gloo)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from fsdp_impl._testing import GRAPH_MODE_ON_CPU
from fsdp_impl.engine import FSDPEngine
from fsdp_impl.unit import FSDPUnit
from tests.functional.common.graph_training import GraphCase, assert_params_equal, eager_steps, full_params, wrap

pytestmark = pytest.mark.distributed(world_size=2, timeout=300)

CPU = torch.device("cpu")


def _wrap(case: GraphCase, graph_mode: bool, prefetch: bool):
    ctx = GRAPH_MODE_ON_CPU.on() if graph_mode else contextlib.nullcontext()
    with ctx:
        return wrap(case, CPU, graph_mode=graph_mode, overlap_param_gather=prefetch)


def _log_events(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    start, pre = FSDPUnit._start_gather, FSDPEngine._pre_forward

    def logged_start(self: FSDPUnit):
        events.append(("gather", self.name))
        return start(self)

    def logged_pre(self: FSDPEngine, unit: FSDPUnit) -> None:
        events.append(("pre", unit.name))
        pre(self, unit)

    monkeypatch.setattr(FSDPUnit, "_start_gather", logged_start)
    monkeypatch.setattr(FSDPEngine, "_pre_forward", logged_pre)
    return events


@pytest.mark.parametrize("graph_mode", [False, True], ids=["normal", "graph"])
@pytest.mark.parametrize("strategy", [1, 2])
def test_refresh_is_prefetched_and_trains_identically(strategy: int, graph_mode: bool, monkeypatch,
                                                       dist_env) -> None:
    case = GraphCase(strategy)
    model, opt = _wrap(case, graph_mode, prefetch=True)
    ref, ref_opt = _wrap(case, graph_mode, prefetch=False)
    got = eager_steps(model, opt, range(3), CPU, torch.float32)
    want = eager_steps(ref, ref_opt, range(3), CPU, torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (got, want)
    assert_params_equal(full_params(model), full_params(ref), "prefetched refresh vs none")

    events = _log_events(monkeypatch)
    eager_steps(model, opt, range(3, 4), CPU, torch.float32)
    order = [name for kind, name in events if kind == "pre"]
    root, blocks = order[0], order[1:]
    assert len(blocks) >= 2, order
    for name in blocks:  # every block's gather started before its own pre-forward ran
        assert events.index(("gather", name)) < events.index(("pre", name)), (name, events)
    assert events.count(("gather", root)) == 1 and all(events.count(("gather", b)) == 1 for b in blocks), events

    events.clear()
    eager_steps(ref, ref_opt, range(3, 4), CPU, torch.float32)
    assert all(events.index(("gather", b)) > events.index(("pre", b)) for b in blocks), \
        f"without prefetch the gathers must follow the pre-forwards (the check above can fail): {events}"


class _SkippableNet(torch.nn.Module):
    """GraphNet's layout (root ``inp``/``out``, one unit per block) whose middle block is skipped
    when ``skip`` is set: a forward that leaves a prefetched refresh gather unused."""

    def __init__(self) -> None:
        super().__init__()
        from tests.functional.common.graph_training import HIDDEN, IN, OUT, Block

        self.inp = torch.nn.Linear(IN, HIDDEN)
        self.blocks = torch.nn.ModuleList([Block(HIDDEN) for _ in range(3)])
        self.out = torch.nn.Linear(HIDDEN, OUT)
        self.skip = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = block(x)
        return self.out(x)


@pytest.mark.parametrize("strategy", [1, 2])
def test_unused_prefetch_is_not_used_after_the_next_step(strategy: int, dist_env) -> None:
    """A forward that skips a unit leaves its prefetched gather (made from the weights of that
    step) unused; after the next optimizer step the unit must gather the new weights, not
    finish the old gather: losses stay bit-identical to the run without prefetch."""
    import fsdp_impl
    from tests.functional.common.graph_training import Block, batch, make_optimizer

    def build(prefetch: bool):
        torch.manual_seed(0)
        module = _SkippableNet()
        opt = make_optimizer("adamw", module.parameters())
        policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
        model, opt = fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[Block], zero_dp_strategy=strategy,
                                           mixed_precision_policy=policy, overlap_param_gather=prefetch)
        return module, model, opt

    runs = []
    for prefetch in (True, False):
        module, model, opt = build(prefetch)
        losses = []
        for step in range(5):
            module.skip = step in (1, 3)
            opt.zero_grad()
            x, y = batch(step, CPU, torch.float32)
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        runs.append(losses)
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True)), runs
