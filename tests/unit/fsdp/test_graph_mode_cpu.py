"""CUDA-graph mode's bookkeeping, run eagerly on CPU/gloo (2 ranks): nothing is captured here
(that is ``tests/functional/test_cuda_graph.py``, GPU only), but everything the engine does
differently in graph mode runs, so its numbers and invariants are checked on every CI run:

- an eager graph-mode run trains bit for bit like a normal run (ZeRO 0-3, plain and HSDP, with
  the PERSISTENT and POOL unshard storage, AdamW(capturable=True) and SGD, with accumulation);
- engine buffers, grad views and ZeRO-3 compute storage keep their addresses across steps;
- ZeRO-1/2 refresh every unit on every forward without the MAX all-reduce agreement;
- ``zero_grad(set_to_none=True)`` is refused, the wrap-time errors name the argument.

``fsdp_impl._testing.GRAPH_MODE_ON_CPU`` is the test-only switch that lets ``cuda_graph_mode=True`` wrap a CPU
model; outside it, graph mode on CPU is an error (checked below).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import fsdp_impl
from fsdp_impl import comm
from fsdp_impl._testing import GRAPH_MODE_ON_CPU
from fsdp_impl.cuda_graph import capture_train_step
from fsdp_impl.module import FullyShardedModule
from fsdp_impl.placement import local_tensor
from fsdp_impl.unit import attach_unshard_pool
from fsdp_impl.unshard_storage import PooledStorage, UnshardStorage
from tests.functional.common.graph_training import (
    Block,
    GraphCase,
    GraphNet,
    assert_params_equal,
    batch,
    eager_steps,
    full_params,
    local_grads,
    make_step_fn,
    wrap,
)

pytestmark = pytest.mark.distributed(world_size=2, timeout=300)

CPU = torch.device("cpu")
STEPS = 3
MICROBATCHES = 2  # the first backward of a cycle only accumulates, the second syncs


def use_pool(model: FullyShardedModule, slots: int = 2) -> None:
    """What ``fully_shard`` does when the POOL unshard storage is requested (e.g. Megatron's
    fsdp_double_buffer): move the non-root ZeRO-3 units' compute params into the pool."""
    engine = model._fsdp_engine
    engine.ctx.unshard = UnshardStorage.double_buffer(slots)
    assert attach_unshard_pool(engine.units[:-1], engine.ctx) is not None


def graph_wrap(case: GraphCase, pool: bool = False, **kwargs):
    with GRAPH_MODE_ON_CPU.on():
        model, opt = wrap(case, CPU, graph_mode=True, **kwargs)
    if pool:
        use_pool(model)
    return model, opt


def train_accumulating(model, opt) -> list[torch.Tensor]:
    """STEPS cycles of MICROBATCHES backwards (auto-sync only on the last), zero_grad(False)."""
    step_fn = make_step_fn(model)
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for m in range(MICROBATCHES):
            model.set_model_auto_sync(m == MICROBATCHES - 1)
            losses.append(step_fn(*batch(step * MICROBATCHES + m, CPU, torch.float32)).detach())
        opt.step()
    return losses


CASES = [GraphCase(s) for s in (0, 1, 2, 3)] + [GraphCase(s, "no_shard") for s in (1, 3)] + [
    GraphCase(3, None, optimizer="sgd")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_graph_mode_trains_like_normal_mode(case: GraphCase, dist_env) -> None:
    normal, normal_opt = wrap(case, CPU, graph_mode=False)
    graph, graph_opt = graph_wrap(case)
    ref = train_accumulating(normal, normal_opt)
    got = train_accumulating(graph, graph_opt)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True)), f"losses {got} vs {ref}"
    assert_params_equal(full_params(graph), full_params(normal), "graph mode vs normal mode")


@pytest.mark.parametrize("graph_mode", [False, True], ids=["normal", "graph"])
def test_zeroed_grad_buffers_are_overwritten_and_user_writes_kept(graph_mode: bool, monkeypatch, dist_env) -> None:
    """After zero_grad(set_to_none=False) the first backward writes the reduced grads into the
    buffer instead of adding them to zeros (one pass fewer); a write into ``.grad`` between
    zero_grad and the backward takes that licence away, so it is still added to."""
    from fsdp_impl.buffers import DataParallelBuffer

    granted: list[bool] = []
    original = DataParallelBuffer.take_zeroed

    def spy(self: DataParallelBuffer, token: object | None) -> bool:
        granted.append(original(self, token))
        return granted[-1]

    monkeypatch.setattr(DataParallelBuffer, "take_zeroed", spy)
    case = GraphCase(3)
    make = graph_wrap if graph_mode else (lambda c: wrap(c, CPU, graph_mode=False))
    model, opt = make(case)
    ref, ref_opt = make(case)
    step_fn, ref_fn = make_step_fn(model), make_step_fn(ref)
    for fn, o in ((step_fn, opt), (ref_fn, ref_opt)):  # one step first: .grad exists from then on
        fn(*batch(0, CPU, torch.float32))
        o.step()
        o.zero_grad(set_to_none=False)
    granted.clear()
    ref_fn(*batch(1, CPU, torch.float32))
    assert granted and all(granted), f"a zeroed buffer was added to instead of overwritten: {granted}"
    granted.clear()
    for p in model.module.parameters():
        local_tensor(p.grad).add_(1.0)  # e.g. a regulariser's grad, added by hand
    step_fn(*batch(1, CPU, torch.float32))
    assert granted and not any(granted), "a buffer written after zero_grad was overwritten"
    want, got = local_grads(ref), local_grads(model)
    for name, g in got.items():
        assert torch.equal(g, want[name] + 1.0), f"{name}: the hand-written grad was lost"


@pytest.mark.parametrize("outer,graph_mode", [(None, False), ("no_shard", True)])
def test_pool_trains_like_own_storage(outer: str | None, graph_mode: bool, dist_env) -> None:
    """ZeRO-3 with the 2-slot pool (graph mode or not) trains like per-unit storage."""
    case = GraphCase(3, outer)
    ref_model, ref_opt = wrap(case, CPU, graph_mode=False)
    if graph_mode:
        model, opt = graph_wrap(case, pool=True)
    else:
        model, opt = wrap(case, CPU, graph_mode=False)
        use_pool(model)
    storages = [u.storage for u in model._fsdp_engine.units]
    assert all(isinstance(s, PooledStorage) for s in storages[:-1]) and not isinstance(storages[-1], PooledStorage)
    ref = train_accumulating(ref_model, ref_opt)
    got = train_accumulating(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert_params_equal(full_params(model), full_params(ref_model), "pool vs own storage")


def _addresses(model: FullyShardedModule) -> dict[str, object]:
    """Everything a captured graph bakes in: buffer and grad addresses, grad objects."""
    engine = model._fsdp_engine
    out: dict[str, object] = {}
    for i, unit in enumerate(engine.units):
        out[f"weight{i}"] = unit.weight.data.data_ptr()
        out[f"compute{i}"] = [(t.untyped_storage().data_ptr(), t.untyped_storage().size(), t.data_ptr())
                              for t in unit.compute_tensors()]
        if unit.grad is not None:
            out[f"grad{i}"] = unit.grad.data.data_ptr()
            out[f"staging{i}"] = [t.data_ptr() for t in unit.staging.tensors()]
    out["grads"] = {n: (id(p.grad), local_tensor(p.grad).data_ptr()) for n, p in model.module.named_parameters()}
    return out


@pytest.mark.parametrize("strategy,pool", [(1, False), (2, False), (3, False), (3, True)])
def test_buffers_keep_their_addresses(strategy: int, pool: bool, dist_env) -> None:
    case = GraphCase(strategy)
    model, opt = graph_wrap(case, pool=pool)
    eager_steps(model, opt, range(2), CPU, torch.float32)  # warm-up: state, grads, staging
    before = _addresses(model)
    eager_steps(model, opt, range(2, 5), CPU, torch.float32)
    assert _addresses(model) == before
    for unit in model._fsdp_engine.units:  # ZeRO-3 compute storage is never freed in graph mode
        assert all(t.untyped_storage().size() > 0 for t in unit.compute_tensors())
    grads = local_grads(model)
    assert grads and all(g.count_nonzero() > 0 for g in grads.values() if g.numel()), "grads vanished"
    # sanity: the same check sees the normal mode's ZeRO-3 free/realloc
    if strategy == 3 and not pool:
        normal, normal_opt = wrap(case, CPU, graph_mode=False)
        eager_steps(normal, normal_opt, range(2), CPU, torch.float32)
        assert any(t.untyped_storage().size() == 0 for u in normal._fsdp_engine.units[:-1]
                   for t in u.compute_tensors())


def _count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    counts = {"all_gather": 0, "all_reduce_max": 0}
    for name in counts:
        original = getattr(comm, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            counts[_name] += 1
            return _original(*args, **kwargs)
        monkeypatch.setattr(comm, name, counted)
    return counts


def test_zero12_refresh_every_forward_without_agreement(monkeypatch, dist_env) -> None:
    """Graph mode: every forward re-gathers every unit (also when nothing changed) and never runs
    the version-counter MAX all-reduce; normal mode skips the gathers when nothing changed."""
    strategy, units_with_params = 2, 1 + 3  # root + Blocks (ZeRO-1 refreshes through the same code)
    for graph_mode, gathers in ((True, units_with_params), (False, 0)):
        model, opt = graph_wrap(GraphCase(strategy)) if graph_mode else wrap(GraphCase(strategy), CPU, False)
        eager_steps(model, opt, range(1), CPU, torch.float32)
        with torch.no_grad():
            model(batch(0, CPU, torch.float32)[0])  # rebuilds after the step
        counts = _count_calls(monkeypatch)
        with torch.no_grad():
            model(batch(1, CPU, torch.float32)[0])  # no optimizer step since the last forward
        assert counts == {"all_gather": gathers, "all_reduce_max": 0 if graph_mode else 1}, (graph_mode, counts)
        monkeypatch.undo()


@pytest.mark.regression("graph-zero-grad-set-to-none-drops-grad-views",
                        description="zero_grad(set_to_none=True) dropped the .grad views of the gradient "
                                    "buffer that a captured CUDA graph writes into: replays silently "
                                    "stopped delivering gradients")
def test_zero_grad_set_to_none_is_refused(dist_env) -> None:
    model, opt = graph_wrap(GraphCase(3))
    eager_steps(model, opt, range(2), CPU, torch.float32)
    grads = {n: id(p.grad) for n, p in model.module.named_parameters()}
    for call in (opt.zero_grad, model.zero_grad):
        with pytest.raises(ValueError, match=r"zero_grad\(set_to_none=True\) is not allowed with "
                                             r"cuda_graph_mode=True: .*call zero_grad\(set_to_none=False\)"):
            call()
    assert {n: id(p.grad) for n, p in model.module.named_parameters()} == grads
    for call in (opt.zero_grad, model.zero_grad):  # the views are hidden from torch's zeroing, then restored
        make_step_fn(model)(*batch(4, CPU, torch.float32))
        assert any(g.any() for g in local_grads(model).values())
        call(set_to_none=False)
        assert {n: id(p.grad) for n, p in model.module.named_parameters()} == grads
        assert all(not g.any() for g in local_grads(model).values())
    make_step_fn(model)(*batch(5, CPU, torch.float32))
    assert {n: id(p.grad) for n, p in model.module.named_parameters()} == grads
    assert all(g.count_nonzero() > 0 for g in local_grads(model).values() if g.numel())


def _is_wrapped(module: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def test_graph_mode_on_cpu_is_an_error(dist_env) -> None:
    with pytest.raises(ValueError, match=r"cuda_graph_mode=True needs a CUDA device mesh .* the mesh is on 'cpu'"):
        wrap(GraphCase(3), CPU, graph_mode=True)


def test_report_nan_is_refused(dist_env) -> None:
    with GRAPH_MODE_ON_CPU.on(), pytest.raises(ValueError, match="report_nan_in_param_grad=True"):
        wrap(GraphCase(2), CPU, graph_mode=True, report_nan_in_param_grad=True)


@pytest.mark.parametrize("make,match", [
    (lambda ps: torch.optim.Adam(ps), r"Adam has capturable=False in param group\(s\) \[0\]"),
    (lambda ps: fsdp_impl.optim.AdamW(ps), r"AdamW has capturable=False in param group\(s\) \[0\]"),
    (lambda ps: torch.optim.LBFGS(ps), r"torch.optim.LBFGS has no capturable option"),
])
def test_non_capturable_optimizer_is_refused(make, match: str, dist_env) -> None:
    module = GraphNet()
    with GRAPH_MODE_ON_CPU.on(), pytest.raises(ValueError, match="cuda_graph_mode=True needs an optimizer .*" + match):
        fsdp_impl.fully_shard(module, make(module.parameters()), fsdp_unit_modules=[Block], cuda_graph_mode=True)
    assert not _is_wrapped(module), "fully_shard must refuse the optimizer before wrapping"
    with GRAPH_MODE_ON_CPU.on():  # the same check when the optimizer is bound after wrapping
        model = fsdp_impl.fully_shard_model(GraphNet(), cuda_graph_mode=True)
    with pytest.raises(ValueError, match=match):
        fsdp_impl.fully_shard_optimizer(make(model.parameters()))
    with GRAPH_MODE_ON_CPU.on():  # SGD is fine (capturable Adam: every other test here)
        other = GraphNet()
        fsdp_impl.fully_shard(other, torch.optim.SGD(other.parameters(), lr=0.1), cuda_graph_mode=True)


def test_capture_train_step_argument_errors(dist_env) -> None:
    normal, normal_opt = wrap(GraphCase(3), CPU, graph_mode=False)
    inputs = batch(0, CPU, torch.float32)
    with pytest.raises(TypeError, match="model must be a model returned by fully_shard"):
        capture_train_step(GraphNet(), normal_opt, make_step_fn(normal), inputs)
    with pytest.raises(ValueError, match="needs a model wrapped with cuda_graph_mode=True"):
        capture_train_step(normal, normal_opt, make_step_fn(normal), inputs)
    model, opt = graph_wrap(GraphCase(3))
    with pytest.raises(ValueError, match=r"capture_train_step needs CUDA: the model runs on cpu"):
        capture_train_step(model, opt, make_step_fn(model), inputs)
    assert dist.get_world_size() == 2
