"""Engine behaviours beyond plain parity: gradient accumulation, uneven / tiny / empty
shards, frozen and tied params, meta init, optimizer param groups, dtypes, decoupled grads,
NaN reporting, flattened mesh dims and torch.compile. Every check compares numbers with an
independent reference (single-process model, the eager-initialised model, closed forms)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

import fsdp_impl
from fsdp_impl import MixedPrecisionPolicy, fully_shard, fully_shard_model, fully_shard_optimizer
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.models import build_model, loss_fn, make_batch, unit_classes
from tests.functional.common.numerics import max_loss_error, max_relative_error, relative_error
from tests.functional.common.reference import global_batch, make_optimizer, train_reference
from tests.functional.common.training import RunConfig, local_slice, train_fsdp

pytestmark = [
    pytest.mark.distributed(world_size=4, timeout=600),
    pytest.mark.matrix(mesh=axes.mesh(4), zero="optim_grads_params", model="cnn", dtype="fp32"),
]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
RTOL = 1e-5


def _reference_grads(model: nn.Module, name: str, global_size: int) -> dict:
    """Full-batch mean-loss grads of an unwrapped copy (what one synced step must produce)."""
    inputs, target = make_batch(name, global_size, seed=1000)
    loss_fn(name)(model(*inputs), target).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
def test_accumulation_grads_absent_until_sync_then_present_everywhere(strategy, dist_env) -> None:
    """Megatron-FSDP's fully_shard test's check plus: after the sync backward every rank that
    owns a non-empty shard has a non-zero grad, and the accumulated grads equal the full-batch
    reference grads."""
    rank, world, micro, per_rank = dist_env.rank, dist_env.world_size, 3, 3
    expected = _reference_grads(build_model("cnn", seed=0), "cnn", world * per_rank)
    module = build_model("cnn", seed=0)
    model, opt = fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.1),
                             fsdp_unit_modules=list(unit_classes("cnn")), zero_dp_strategy=strategy)
    inputs, target = make_batch("cnn", world * per_rank, seed=1000)
    x, y = local_slice(inputs[0], rank, per_rank), local_slice(target, rank, per_rank)
    for m in range(micro):
        model.set_model_auto_sync(m == micro - 1)
        (loss_fn("cnn")(model(x[m:m + 1]), y[m:m + 1]) / micro).backward()
        present = [p.grad is not None for p in model.parameters()]
        if m < micro - 1:
            assert not any(present), f"grads present before the sync microbatch {m}"
    assert all(present), "every trainable param must have a grad after the sync backward"
    for name, p in model.module.named_parameters():
        assert isinstance(p.grad, DTensor) and p.grad.placements == p.placements
        local = p.grad.to_local()
        if local.numel() > 0:
            assert local.count_nonzero() > 0, f"rank {rank}: zero grad on non-empty shard of {name}"
        full = p.grad.full_tensor()
        err = relative_error(full, expected[name])
        assert err <= RTOL, f"{name}: accumulated grad differs from reference by {err:.3g}"
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    # set_to_none=True also releases the grad buffers until the next reduction (memory, like FSDP2)
    assert not any(g.main_grad_buffer.is_allocated for g in model.param_and_grad_buffer.parameter_groups
                   if g.main_grad_buffer is not None and g.main_grad_buffer.data.numel())


class TinyParams(nn.Module):
    """Many tiny params (1..5 rows, some smaller than the world) in a few units."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 1), nn.Linear(1, 3)])
        self.scale = nn.Parameter(torch.tensor([0.5]))
        self.shift = nn.Parameter(torch.randn(5, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x * self.scale + self.shift[:3, 0]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), model="tiny_params")
def test_tiny_and_empty_shards_train_like_reference(strategy, dist_env) -> None:
    rank, world = dist_env.rank, dist_env.world_size
    torch.manual_seed(3)
    module = TinyParams()
    ref = TinyParams()
    ref.load_state_dict(module.state_dict())
    model, opt = fully_shard(module, make_optimizer("sgd", module.named_parameters(), lr=0.1),
                             fsdp_unit_modules=[nn.Linear], zero_dp_strategy=strategy)
    ref_opt = make_optimizer("sgd", ref.named_parameters(), lr=0.1)
    empty = [n for n, p in model.module.named_parameters() if p.to_local().numel() == 0]
    if strategy != "no_shard" and rank > 0:
        assert "scale" in empty, "a 1-element param must leave ranks > 0 with an empty shard"
    gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        x, y = torch.randn(world * 2, 2, generator=gen), torch.randn(world * 2, 3, generator=gen)
        nn.functional.mse_loss(model(local_slice(x, rank, 2)), local_slice(y, rank, 2)).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    got = {n: p.full_tensor() for n, p in model.module.named_parameters()}
    err, where = max_relative_error(got, dict(ref.named_parameters()))
    assert err <= RTOL, f"{where}: {err:.3g}"


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), model="transformer")
def test_frozen_params_stay_frozen_and_have_no_grad_buffer(strategy, dist_env) -> None:
    def frozen_model() -> nn.Module:
        model = build_model("transformer", seed=0)
        for name, p in model.named_parameters():
            if name.startswith(("encoder", "src_in")):
                p.requires_grad_(False)
        return model

    cfg = RunConfig(model="transformer", optimizer="sgd", strategy=strategy, steps=3)
    losses, final, model = train_fsdp(cfg, dist_env.device, model=frozen_model())
    ref_losses, ref_params = train_reference(frozen_model(), "transformer", "sgd", 3, dist_env.world_size * 3)
    err, where = max_relative_error(final, ref_params)
    assert err <= RTOL, f"{where}: {err:.3g}"
    initial = dict(frozen_model().named_parameters())
    for name, p in model.module.named_parameters():
        if name.startswith(("encoder", "src_in")):
            assert not p.requires_grad and p.grad is None
            assert torch.equal(final[name], initial[name].detach()), f"frozen {name} changed"
    for group in model.param_and_grad_buffer.parameter_groups:
        if group.name.startswith("encoder"):
            assert group.main_grad_buffer is None, "a frozen unit must get no grad buffer"


@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), model="gpt")
def test_tied_weights_across_modules(strategy, dist_env) -> None:
    cfg = RunConfig(model="gpt", optimizer="adam", strategy=strategy, steps=3)
    losses, final, model = train_fsdp(cfg, dist_env.device, model=build_model("gpt", tie_module=True))
    ref_losses, ref_params = train_reference(build_model("gpt", tie_module=True), "gpt", "adam", 3,
                                             dist_env.world_size * 3)
    assert max_loss_error(losses, ref_losses) <= RTOL, f"losses {losses} vs reference {ref_losses}"
    err, where = max_relative_error(final, ref_params)
    assert err <= RTOL, f"{where}: {err:.3g}"
    assert model.module.lm_head.weight is model.module.tok.weight


@pytest.mark.parametrize("name", ["cnn", "transformer", "gpt"])
@pytest.mark.parametrize("strategy", ["optim", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), model=matrix.param("name"))
def test_meta_init_equals_eager_init(name, strategy, dist_env) -> None:
    eager = dict(build_model(name, seed=5).named_parameters())
    model = fully_shard_model(build_model(name, seed=5, device="meta"), fsdp_unit_modules=list(unit_classes(name)),
                              zero_dp_strategy=strategy, init_model_with_meta_device=True)
    for pname, p in model.module.named_parameters():
        assert not p.to_local().is_meta
        assert torch.equal(p.full_tensor(), eager[pname].detach()), f"{pname} differs from eager init"


def test_optimizer_param_groups_preserved_and_first_step_is_step_one(dist_env) -> None:
    module = build_model("cnn", seed=0)
    opt = make_optimizer("adam", module.named_parameters())
    before = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])} for g in opt.param_groups]
    model, opt2 = fully_shard(module, opt, fsdp_unit_modules=list(unit_classes("cnn")))
    assert opt2 is opt and isinstance(opt, torch.optim.Adam)
    after = [{k: v for k, v in g.items() if k != "params"} | {"n": len(g["params"])} for g in opt.param_groups]
    assert before == after
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    inputs, target = make_batch("cnn", 4, seed=0)
    loss_fn("cnn")(model(*inputs), target).backward()
    assert all(len(s) == 0 for s in opt.state.values()), "no state before the first step"
    opt.step()
    steps = {float(opt.state[p]["step"]) for g in opt.param_groups for p in g["params"]}
    assert steps == {1.0}


def _train_three_steps(kind: str, strategy: str, local_step: bool, rank: int, world: int
                       ) -> tuple[list[float], dict[str, torch.Tensor], list[dict[str, torch.Tensor]], object]:
    module = build_model("transformer", seed=0)
    model, opt = fully_shard(module, make_optimizer(kind, module.named_parameters()),
                             fsdp_unit_modules=list(unit_classes("transformer")), zero_dp_strategy=strategy)
    if not local_step:
        opt._fsdp_local_step = None  # the DTensor path, as before local-shard steps
    losses = []
    for step in range(3):
        inputs, target = global_batch("transformer", step, world * 2, torch.float32)
        loss = loss_fn("transformer")(model(*[local_slice(x, rank, 2) for x in inputs]), local_slice(target, rank, 2))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {n: p.to_local().clone() for n, p in model.module.named_parameters()}
    state = [{k: (v.to_local() if isinstance(v, DTensor) else v).clone() for k, v in opt.state[p].items()}
             for g in opt.param_groups for p in g["params"]]
    assert all(isinstance(v, DTensor) for g in opt.param_groups for p in g["params"]
               for k, v in opt.state[p].items() if k != "step"), "optimizer state must stay DTensor-shaped"
    return losses, params, state, opt._fsdp_local_step


@pytest.mark.parametrize("kind", ["adam", "sgd"])
@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), model="transformer")
def test_optimizer_steps_on_local_shards_bit_identical(kind, strategy, dist_env) -> None:
    """A bound torch Adam / SGD steps on the shards' local tensors (no DTensor dispatch): losses,
    params and every state entry equal the DTensor step's bit for bit, and the state stays DTensor."""
    rank, world = dist_env.rank, dist_env.world_size
    mine = _train_three_steps(kind, strategy, True, rank, world)
    ref = _train_three_steps(kind, strategy, False, rank, world)
    assert mine[3] is not None and mine[3]._aliases, "the local-shard step was not taken"
    assert mine[0] == ref[0], f"losses differ: {mine[0]} vs {ref[0]}"
    for name in ref[1]:
        assert torch.equal(mine[1][name], ref[1][name]), f"{name} differs after 3 steps"
    for a, b in zip(mine[2], ref[2], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.matrix(zero="no_shard")
def test_local_step_takes_a_partial_grad_as_its_sum(dist_env) -> None:
    """A hand-written ``Partial`` grad (each rank holds a summand) must not be stepped on its
    local tensor: the bound optimizer takes the DTensor path and applies the reduced grad."""
    from torch.distributed.tensor import Partial

    module = build_model("cnn", seed=0)
    model, opt = fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.5),
                             fsdp_unit_modules=list(unit_classes("cnn")), zero_dp_strategy="no_shard")
    params = list(model.parameters())
    before = [p.to_local().clone() for p in params]
    for p in params:
        p.grad = DTensor.from_local(torch.ones_like(p.to_local()), p.device_mesh, [Partial()] * p.device_mesh.ndim,
                                    run_check=False)
    opt.step()
    for p, b in zip(params, before, strict=True):  # the full grad is world x ones
        assert torch.equal(p.to_local(), b - 0.5 * dist_env.world_size), "stepped on the local summand"


@pytest.mark.matrix(model="transformer", dtype="fp64")
def test_custom_dtypes_and_mixed_precision_context(dist_env) -> None:
    """Megatron-FSDP's fully_shard test's custom-dtype check: buffer dtypes follow the policy; grads reach the fp64 main
    params as a cast copy; grad comm dtype can change per scope; values match the reference."""
    module = build_model("transformer", seed=0)
    expected = _reference_grads(build_model("transformer", seed=0), "transformer", dist_env.world_size)
    model, opt = fully_shard(module, torch.optim.SGD(module.parameters(), lr=0.0),
                             fsdp_unit_modules=list(unit_classes("transformer")),
                             mixed_precision_policy=MixedPrecisionPolicy(torch.float64, torch.float32))
    groups = model.param_and_grad_buffer.parameter_groups
    assert groups[0].main_weight_buffer.data.dtype == torch.float64
    assert groups[0].main_grad_buffer.data.dtype == torch.float32
    inputs, target = make_batch("transformer", dist_env.world_size, seed=1000)
    mine = [local_slice(x, dist_env.rank, 1) for x in inputs]
    for comm_dtype, tol in ((None, RTOL), (torch.float16, 2e-3)):
        with model.mixed_precision_context(MixedPrecisionPolicy(grad_comm_dtype=comm_dtype)):
            loss_fn("transformer")(model(*mine), local_slice(target, dist_env.rank, 1)).backward()
        for name, p in model.module.named_parameters():
            assert p.grad.dtype == torch.float64
            err = relative_error(p.grad.full_tensor(), expected[name])
            assert err <= tol, f"grad_comm_dtype={comm_dtype}: {name} off by {err:.3g}"
        opt.zero_grad()
    plain = fully_shard_model(build_model("cnn"), mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=None))
    assert plain.param_and_grad_buffer.parameter_groups[0].main_weight_buffer is None


def test_decoupled_grad_written_instead_of_grad(dist_env) -> None:
    module = build_model("cnn", seed=0)
    expected = _reference_grads(build_model("cnn", seed=0), "cnn", dist_env.world_size)
    model = fully_shard_model(module, fsdp_unit_modules=list(unit_classes("cnn")), use_decoupled_grad=True)
    opt = fully_shard_optimizer(fsdp_impl.optim.Adam(model.parameters(), lr=1e-2, use_decoupled_grad=True))
    assert model.param_and_grad_buffer.use_decoupled_grad
    inputs, target = make_batch("cnn", dist_env.world_size, seed=1000)
    loss_fn("cnn")(model(local_slice(inputs[0], dist_env.rank, 1)), local_slice(target, dist_env.rank, 1)).backward()
    for name, p in model.module.named_parameters():
        assert p.grad is None
        err = relative_error(p.decoupled_grad.full_tensor(), expected[name])
        assert err <= RTOL, name
    before = {n: p.full_tensor().clone() for n, p in model.module.named_parameters()}
    opt.step()
    assert all(not torch.equal(before[n], p.full_tensor()) for n, p in model.module.named_parameters())
    opt.zero_grad()
    assert all(getattr(p, "decoupled_grad", None) is None for p in model.parameters())
    plain = build_model("cnn")
    with pytest.raises(ValueError, match="decoupled"):  # torch Adam reads .grad: mismatch at wrap time
        fully_shard(plain, torch.optim.Adam(plain.parameters()), use_decoupled_grad=True)


def test_report_nan_in_param_grad_names_the_parameter(dist_env) -> None:
    module = build_model("cnn", seed=0)
    model = fully_shard_model(module, fsdp_unit_modules=list(unit_classes("cnn")), report_nan_in_param_grad=True)
    inputs, target = make_batch("cnn", 1, seed=0)
    x = inputs[0].clone()
    x[0, 0, 0, 0] = float("nan")
    with pytest.raises(RuntimeError, match=r"NaN found in the gradient of parameter\(s\) \[.*'conv1.weight'"):
        loss_fn("cnn")(model(x), target).backward()


@pytest.mark.matrix(mesh=axes.mesh(2, cp=2))
def test_flattened_dp_shard_cp_dim_and_size1_tp_dim(dist_env) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp_shard", "cp", "tp"))
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    try:
        cfg = RunConfig(model="cnn", optimizer="sgd", strategy=3, steps=2)
        losses, final, model = train_fsdp(cfg, dist_env.device, device_mesh=mesh, dp_shard_dim="dp_shard_cp",
                                          tp_dim="tp")
        assert model.dist_index.get_fsdp_group().size() == 4 and model.dist_index.get_tp_group() is None
        _, ref_params = train_reference(build_model("cnn"), "cnn", "sgd", 2, dist_env.world_size * 3)
        err, where = max_relative_error(final, ref_params)
        assert err <= RTOL, f"{where}: {err:.3g}"
    finally:
        del model
        for name in ("dp_shard", "cp", "tp", "dp_shard_cp"):
            group = mesh[name].get_group()
            if group is not dist.group.WORLD and group != dist.GroupMember.WORLD:
                dist.destroy_process_group(group)


@pytest.mark.matrix(graph="compile")
def test_torch_compile_runs_and_matches_eager(dist_env) -> None:
    eager = RunConfig(model="cnn", optimizer="sgd", strategy=3, steps=2)
    eager_losses, eager_final, _ = train_fsdp(eager, dist_env.device)
    module = build_model("cnn", seed=0)
    model, opt = fully_shard(module, make_optimizer("sgd", module.named_parameters()),
                             fsdp_unit_modules=list(unit_classes("cnn")))
    compiled = torch.compile(model, backend="aot_eager")
    rank, world = dist_env.rank, dist_env.world_size
    for step in range(2):
        inputs, target = global_batch("cnn", step, world * 3, torch.float32)
        loss = loss_fn("cnn")(compiled(local_slice(inputs[0], rank, 3)), local_slice(target, rank, 3))
        loss.backward()
        opt.step()
        opt.zero_grad()
    final = {n: p.full_tensor() for n, p in model.module.named_parameters()}
    err, where = max_relative_error(final, eager_final)
    assert err <= RTOL, f"{where}: {err:.3g}"


def _log_gathers(monkeypatch) -> list[tuple[str, str]]:
    """A list that gets ("gather", unit name) each time a unit starts an all-gather."""
    from fsdp_impl.unit import FSDPUnit

    events: list[tuple[str, str]] = []
    original = FSDPUnit._start_gather

    def logged(self):
        events.append(("gather", self.name))
        return original(self)

    monkeypatch.setattr(FSDPUnit, "_start_gather", logged)
    return events


def test_zero3_prefetches_next_unit_all_gather(dist_env, monkeypatch) -> None:
    """From the second iteration on, unit k+1's all-gather is issued before unit k's forward runs
    (forward prefetch) and unit k-1's before unit k's backward ends (backward prefetch)."""
    events = _log_gathers(monkeypatch)
    module = build_model("cnn", seed=0)
    model = fully_shard_model(module, fsdp_unit_modules=list(unit_classes("cnn")))
    for name in ("conv1", "conv2", "head"):
        getattr(model.module, name).register_forward_hook(
            lambda mod, args, out, name=name: events.append(("forward", name)))
    inputs, target = make_batch("cnn", 2, seed=0)
    for _ in range(2):
        events.clear()
        loss_fn("cnn")(model(*inputs), target).backward()
    fwd = events[:events.index(("forward", "head")) + 1]
    assert fwd.index(("gather", "conv2")) < fwd.index(("forward", "conv1"))
    assert fwd.index(("gather", "head")) < fwd.index(("forward", "conv2"))
    bwd = events[len(fwd):]
    assert [e[1] for e in bwd] == ["head", "conv2", "conv1"], bwd  # one gather per unit, in order


@pytest.mark.matrix(model="gpt")
def test_zero3_root_prefetches_first_and_last_unit(dist_env, monkeypatch) -> None:
    """The root opens both passes: its pre-forward starts block 0's all-gather before the
    embedding runs, and its pre-backward (the logits' grad) starts the last block's before the
    backward of the root's own final norm, instead of when each block is reached."""
    events = _log_gathers(monkeypatch)
    module = build_model("gpt", seed=0, layers=3)
    model = fully_shard_model(module, fsdp_unit_modules=list(unit_classes("gpt")))
    gpt = model.module
    gpt.tok.register_forward_hook(lambda *_: events.append(("forward", "tok")))
    gpt.norm.register_full_backward_pre_hook(lambda *_: events.append(("backward", "norm")))
    inputs, target = make_batch("gpt", 2, seed=0)
    for _ in range(2):  # the forward prefetch follows the previous iteration's order
        events.clear()
        loss_fn("gpt")(model(*inputs), target).backward()
    gathers = [e for e in events if e[0] == "gather"]
    assert len(gathers) == 1 + 2 * 3, events  # the root once, every block in forward and in backward
    assert events.index(("gather", "blocks.0")) < events.index(("forward", "tok")), events
    forward_gather, backward_gather = [i for i, e in enumerate(events) if e == ("gather", "blocks.2")]
    assert forward_gather < events.index(("backward", "norm")), events
    assert backward_gather < events.index(("backward", "norm")), events


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.matrix(model="gpt", dtype="bf16", zero=matrix.param("strategy", axes.zero))
def test_cast_shards_are_gathered_in_place(strategy, dist_env, monkeypatch) -> None:
    """A bf16 module with fp32 main params: every weight all-gather casts the shard straight into
    this rank's chunk of the output and gathers in place (input = output chunk ``group rank``).
    NCCL reads an input that overlaps its output anywhere else while overwriting it, so a wrong
    chunk corrupts weights on GPUs while gloo (CPU) still gives right numbers: this pins it."""
    import fsdp_impl.comm

    calls: list[tuple[int, int, int, int, torch.dtype]] = []
    original = fsdp_impl.comm.all_gather

    def spy(output: torch.Tensor, local: torch.Tensor, group: dist.ProcessGroup) -> None:
        calls.append((output.data_ptr(), local.data_ptr(), local.numel() * local.element_size(),
                      group.rank(), local.dtype))
        original(output, local, group)

    monkeypatch.setattr(fsdp_impl.comm, "all_gather", spy)
    module = build_model("gpt", torch.bfloat16, seed=0, layers=2)
    policy = MixedPrecisionPolicy(main_params_dtype=torch.float32, main_grads_dtype=torch.float32)
    model, opt = fully_shard(module, torch.optim.AdamW(module.parameters(), lr=1e-3),
                             fsdp_unit_modules=list(unit_classes("gpt")), zero_dp_strategy=strategy,
                             mixed_precision_policy=policy)
    inputs, target = make_batch("gpt", 2, seed=0)
    for _ in range(2):
        loss_fn("gpt")(model(*inputs), target).backward()
        opt.step()
        opt.zero_grad()
    assert calls, "no weight all-gather was issued"
    for out_ptr, in_ptr, nbytes, rank, dtype in calls:
        assert dtype == torch.bfloat16, calls
        assert in_ptr == out_ptr + rank * nbytes, (rank, out_ptr, in_ptr, nbytes)


@pytest.mark.parametrize("strategy", ["no_shard", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
def test_zero_grad_keep_views_trains_like_reference(strategy, dist_env) -> None:
    """``zero_grad(set_to_none=False)`` keeps every ``.grad`` a view of the grad buffer across
    steps (what CUDA-graph capture needs) and training still matches the reference."""
    rank, world = dist_env.rank, dist_env.world_size
    module = build_model("cnn", seed=0)
    model, opt = fully_shard(module, make_optimizer("sgd", module.named_parameters()),
                             fsdp_unit_modules=list(unit_classes("cnn")), zero_dp_strategy=strategy)
    views = None
    for step in range(3):
        inputs, target = global_batch("cnn", step, world * 3, torch.float32)
        loss_fn("cnn")(model(local_slice(inputs[0], rank, 3)), local_slice(target, rank, 3)).backward()
        grads = [p.grad for p in model.parameters()]
        if views is not None:
            assert all(g is v for g, v in zip(grads, views, strict=True)), "grads must stay the same view objects"
        views = grads
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert all(int(g.to_local().count_nonzero()) == 0 for g in grads)
    buffers = [g.main_grad_buffer.data for g in model.param_and_grad_buffer.parameter_groups
               if g.main_grad_buffer is not None]
    ptrs = {b.untyped_storage().data_ptr() for b in buffers}
    assert all(v.to_local().untyped_storage().data_ptr() in ptrs for v in views)
    _, ref_params = train_reference(build_model("cnn", seed=0), "cnn", "sgd", 3, world * 3)
    err, where = max_relative_error({n: p.full_tensor() for n, p in model.module.named_parameters()}, ref_params)
    assert err <= RTOL, f"{where}: {err:.3g}"


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
def test_in_place_weight_edits_reach_the_next_forward(strategy, dist_env) -> None:
    """Compute params are rebuilt when the main weights change by any in-place path: a DTensor
    op, an edit of ``to_local()`` or of the weight buffer (closed form: zero weights -> zero out)."""
    model = fully_shard_model(build_model("cnn", seed=0), fsdp_unit_modules=list(unit_classes("cnn")),
                              zero_dp_strategy=strategy)
    inputs, _ = make_batch("cnn", 2, seed=0)
    assert model(*inputs).abs().sum() > 0
    edits = [
        lambda: [p.zero_() for p in model.parameters()],
        lambda: [p.to_local().fill_(1.0) for p in model.parameters()],
        lambda: [g.model_weight_buffer.data.zero_() for g in model.param_and_grad_buffer.parameter_groups],
    ]
    expected = [torch.zeros(2, 3), None, torch.zeros(2, 3)]
    for edit, want in zip(edits, expected, strict=True):
        with torch.no_grad():
            edit()
            out = model(*inputs)
        if want is None:  # all ones: the closed form of the ones-network on this input
            ref = build_model("cnn")
            for p in ref.parameters():
                nn.init.ones_(p)
            want = ref(*inputs)
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), f"edit {edit} not seen by forward"


@pytest.mark.regression("fused-optimizer-stale-compute-weights",
                         description="ZeRO-1/2 kept the compute weights of before a fused optimizer's step")
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero))
def test_fused_optimizer_step_reaches_the_next_forward(strategy, dist_env) -> None:
    """The fused Adam kernel (``torch._fused_adam_``, run on the local shards by
    ``fsdp_impl.optim.Adam(fused=True)``) updates the params in place without bumping their
    version counters, which the ZeRO-1/2 refresh read: the next forward used the weights of
    before the step (measured: params 0.021 off the foreach run after 3 steps at ZeRO-1). Fused
    and foreach Adam agree to rounding, so the two runs' params must match within 1e-5 relative."""
    finals = {}
    for fused in (False, True):
        module = build_model("cnn", seed=0)
        opt = fsdp_impl.optim.Adam(module.parameters(), lr=1e-2, fused=fused, foreach=not fused)
        model, opt = fully_shard(module, opt, fsdp_unit_modules=list(unit_classes("cnn")), zero_dp_strategy=strategy)
        for step in range(3):
            inputs, target = make_batch("cnn", 2, seed=step)
            loss_fn("cnn")(model(*inputs), target).backward()
            opt.step()
            opt.zero_grad()
        finals[fused] = {n: p.full_tensor().detach().clone() for n, p in model.module.named_parameters()}
    err = max(relative_error(finals[True][n], finals[False][n]) for n in finals[False])
    assert err <= RTOL, f"fused Adam's params are {err:.3g} off foreach Adam's after 3 steps (stale compute weights)"


@pytest.mark.parametrize("strategy", ["optim_grads", "optim_grads_params"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), model="transformer")
def test_eval_forward_between_training_steps(strategy, dist_env) -> None:
    rank, world = dist_env.rank, dist_env.world_size
    module, ref = build_model("transformer", seed=0), build_model("transformer", seed=0)
    model, opt = fully_shard(module, make_optimizer("sgd", module.named_parameters()),
                             fsdp_unit_modules=list(unit_classes("transformer")), zero_dp_strategy=strategy)
    ref_opt = make_optimizer("sgd", ref.named_parameters())
    for step in range(3):
        inputs, target = global_batch("transformer", step, world * 2, torch.float32)
        mine = [local_slice(x, rank, 2) for x in inputs]
        loss_fn("transformer")(model(*mine), local_slice(target, rank, 2)).backward()
        loss_fn("transformer")(ref(*inputs), target).backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        model.eval()
        with torch.no_grad():
            out, want = model(*mine), ref(*mine)
        model.train()
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-6), f"eval output differs after step {step}"
    err, where = max_relative_error({n: p.full_tensor() for n, p in model.module.named_parameters()},
                                    dict(ref.named_parameters()))
    assert err <= RTOL, f"{where}: {err:.3g}"
