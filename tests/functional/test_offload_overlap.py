"""``OffloadPolicy(overlap_step=...)``: the optimizer step overlapped with the backward, on gloo.

The reference of each overlapped run is the same offloaded run without overlap (``step="cpu"``:
the fused host kernel, ``step="gpu"``: the streamed step, which also equals no offload), from the
same init on the same batches, two microbatches per step (grad accumulation: only the sync
backward may step). Everything must be **bit-identical**: losses, the trained params and the
optimizer state; with ``overlap_step="clip"`` also every step's grad norm. A unit stepped on
stale or partial grads, twice, or not at all shows as a difference of order lr = 1e-2.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_impl
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.models import build_model, unit_classes
from tests.functional.common.offload import full_tensor, train, window
from tests.functional.common.reference import global_batch

pytestmark = [pytest.mark.matrix(model="gpt", dtype="fp32", mesh=axes.mesh(2))]
OVERLAP_ATTR = "_fsdp_offload_overlap"


def _overlap_policy(step: str, device: torch.device, overlap: Any) -> fsdp_impl.OffloadPolicy:
    extra = dict(chunk_bytes=4096) if step == "gpu" else {}
    return fsdp_impl.OffloadPolicy(step=step, pin_memory=device.type == "cuda", overlap_step=overlap, **extra)


def _state(opt: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Each param's optimizer state, global values (moments) and the step counters."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state.get(p, {})
        out[name] = {k: full_tensor(v) if hasattr(v, "full_tensor") else v.detach().cpu().clone()
                     for k, v in state.items()}
    return out


def _assert_identical(run: tuple, ref: tuple, what: str) -> None:
    losses, final, model, opt = run
    ref_losses, ref_final, ref_model, ref_opt = ref
    assert losses == ref_losses, f"{what}: losses {losses} != {ref_losses}"
    for name, value in ref_final.items():
        assert torch.equal(final[name], value), (
            f"{what}: {name} differs (max abs {(final[name] - value).abs().max().item():.3e})")
    state, ref_state = _state(opt, model), _state(ref_opt, ref_model)
    for name, entries in ref_state.items():
        assert entries.keys() == state[name].keys(), f"{what}: {name}'s state keys differ"
        for key, value in entries.items():
            got = state[name][key]
            assert got.dtype == value.dtype and got.device == value.device and torch.equal(got, value), (
                f"{what}: state {key} of {name} differs")


def _no_worker_left() -> None:
    alive = [t.name for t in threading.enumerate() if t.name == "fsdp-offload-step"]
    assert not alive, f"overlap worker threads outlived the step: {alive}"


# ---------------------------------------------------------------------------------- parity
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("strategy", [2, 3], ids=["zero2", "zero3"])
@pytest.mark.parametrize("step", ["cpu", "gpu"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), offload=matrix.param("step", lambda s: f"{s}_overlap"))
def test_overlapped_step_equals_the_step_after_the_backward(step: str, strategy: int, dist_env) -> None:
    """overlap_step=True vs False: losses, params and optimizer state bit for bit; every unit
    queued once per step, most during the backward; no worker thread left behind."""
    device = dist_env.device
    runs = {}
    with window(device):
        for overlap in (False, True):
            kwargs = dict(zero_dp_strategy=strategy, offload_policy=_overlap_policy(step, device, overlap))
            runs[overlap] = train("gpt", device, kwargs, steps=4)
    _assert_identical(runs[True], runs[False], f"step={step}, ZeRO-{strategy}")
    model, opt = runs[True][2], runs[True][3]
    times = opt.__dict__[OVERLAP_ATTR].last_times
    units = len(model._fsdp_engine.units)
    assert times.landed + times.at_end == units and times.landed >= units - 1, (times.landed, times.at_end)
    if step == "cpu":  # each unit's new weights were uploaded after its host step, not left to the next forward
        # each unit's host Adam timed once with its elements (the bench's rates): this rank's local shards
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters())
        assert len(times.stepped) == units and sum(n for _, _, n in times.stepped) == local, (times.stepped, local)
        assert all(b >= a for a, b, _ in times.stepped)
        for unit in model._fsdp_engine.units:
            shard = unit.offload.compute_shard
            assert unit.offload.shard_is_fresh(), f"{unit.name}: compute shard not refreshed after its step"
            assert torch.equal(shard, unit.offload.weight.data.to(shard.dtype)), f"{unit.name}: stale compute shard"
        with window(device):  # upload_ahead=False: the same numbers, the upload left to the next forward
            policy = dataclasses.replace(_overlap_policy(step, device, True), upload_ahead=False)
            late = train("gpt", device, dict(zero_dp_strategy=strategy, offload_policy=policy), steps=4)
        _assert_identical(late, runs[False], f"upload_ahead=False, ZeRO-{strategy}")
        assert not any(u.offload.shard_is_fresh() for u in late[2]._fsdp_engine.units)
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("strategy", [2, 3], ids=["zero2", "zero3"])
@pytest.mark.matrix(zero=matrix.param("strategy", axes.zero), offload="cpu_overlap", dtype="bf16")
def test_params_on_the_host_take_a_copy_uploaded_ahead(strategy: int, dist_env) -> None:
    """params=True, step='cpu', overlap_step=True, bf16 compute: after its host step each unit's
    new weights wait on the device in a compute-dtype copy that the next forward's gather takes
    (and drops); the numbers equal the non-overlapped run bit for bit. A weight edit between the
    step and that gather is seen (the copy is stale), and upload_ahead=False leaves no copy."""
    device = dist_env.device
    runs = {}
    for overlap in (False, True):
        policy = dataclasses.replace(_overlap_policy("cpu", device, overlap), params=True)
        runs[overlap] = train("gpt", device, dict(zero_dp_strategy=strategy, offload_policy=policy), steps=4,
                              dtype=torch.bfloat16)
    _assert_identical(runs[True], runs[False], f"params=True, ZeRO-{strategy}")
    units = runs[True][2]._fsdp_engine.units
    for unit in units:
        ahead, weight = unit.offload.ahead, unit.offload.weight.data
        assert ahead is not None, f"{unit.name}: no copy uploaded after its step"
        assert ahead[0].dtype == torch.bfloat16 and torch.equal(ahead[0], weight.to(torch.bfloat16)), unit.name
    source = units[0].offload  # an edit after the step: the copy is stale, the gather uploads the new values
    with torch.no_grad():
        source.weight.data.add_(1.0)  # moves the buffer's version counter
    fresh = source.gather_source()
    assert fresh.dtype == source.weight.data.dtype and torch.equal(fresh, source.weight.data), "stale copy used"
    assert source.ahead is None
    with torch.no_grad():
        runs[True][2](*_gpt_inputs(device))  # a forward takes every other unit's copy
    assert not any(u.offload.has_ahead_copy for u in units), "a forward left copies on the device"
    policy = dataclasses.replace(_overlap_policy("cpu", device, True), params=True, upload_ahead=False)
    late = train("gpt", device, dict(zero_dp_strategy=strategy, offload_policy=policy), steps=4, dtype=torch.bfloat16)
    _assert_identical(late, runs[False], f"params=True, upload_ahead=False, ZeRO-{strategy}")
    assert not any(u.offload.has_ahead_copy for u in late[2]._fsdp_engine.units)
    _no_worker_left()


def _host_copy_units(device: torch.device, params: bool, overlap: Any, copy: Any) -> list:
    """Train with ``compute_copy_on_host=copy`` and without overlap (bf16 compute, ZeRO-3):
    bit-identical runs; every unit's host copy is the bf16 cast of its current weights. The units."""
    runs = {}
    for mode in (False, overlap):
        policy = dataclasses.replace(_overlap_policy("cpu", device, mode), params=params,
                                     compute_copy_on_host=copy if mode is not False else False)
        runs[mode] = train("gpt", device, dict(zero_dp_strategy=3, offload_policy=policy), steps=4,
                           dtype=torch.bfloat16)
    _assert_identical(runs[overlap], runs[False], f"compute_copy_on_host={copy!r}, params={params}, overlap={overlap}")
    fsdp_impl.wait_for_step(runs[overlap][3])
    units = runs[overlap][2]._fsdp_engine.units
    for unit in units:
        offload = unit.offload
        assert offload.host_copy is not None and offload.host_copy.dtype == torch.bfloat16, unit.name
        assert offload.host_copy_version == offload.version(), f"{unit.name}: host copy not made after the step"
        assert torch.equal(offload.host_copy, offload.weight.data.to(torch.bfloat16)), f"{unit.name}: stale host copy"
    return units


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("params,overlap", [(True, True), (False, True), (True, "forward")],
                         ids=["host_params", "device_shard", "host_params-forward"])
@pytest.mark.matrix(zero="optim_grads_params", offload="cpu_overlap", dtype="bf16")
def test_uploads_send_the_compute_copy_made_on_the_host(params: bool, overlap: Any, dist_env) -> None:
    """compute_copy_on_host=True, bf16 compute, ZeRO-3: the worker casts each unit's new weights
    into a host bf16 copy after its step and every upload sends that copy; the numbers equal
    overlap_step=False bit for bit (the host cast rounds as the device cast). The gathers read
    the copy (a copy changed behind the weights' back shows in the next gather) and not once the
    weights moved on without it."""
    units = _host_copy_units(dist_env.device, params, overlap, True)
    offload = units[-1].offload
    offload.ahead, offload.shard_version = None, -1  # the next gather uploads
    offload.host_copy.fill_(3.0)  # behind the weights' back: only the copy says 3
    assert torch.all(offload.gather_source() == 3.0), "the gather did not send the host copy"
    offload.shard_version = -1
    with torch.no_grad():
        offload.weight.data.mul_(2.0)  # the weights moved on: the copy is stale
    got = offload.gather_source()
    assert torch.equal(got.float(), offload.weight.data.to(got.dtype).float()), "a stale host copy was sent"
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("overlap", [True, "forward"], ids=["overlap", "forward"])
@pytest.mark.matrix(zero="optim_grads_params", offload="cpu_overlap", dtype="bf16")
def test_backward_gathers_send_the_device_cast_brought_down(overlap: Any, dist_env) -> None:
    """compute_copy_on_host='device', params=True, bf16 compute, ZeRO-3: the device's cast of each
    copy uploaded ahead comes down into the host copy, and the backward's gathers send it; the
    numbers equal overlap_step=False bit for bit. The forward's gather takes the copy ahead (not
    the host copy); a host copy changed behind the weights' back shows in the next upload from
    the host, and a stale one is never sent."""
    units = _host_copy_units(dist_env.device, True, overlap, "device")
    assert all(u.offload.has_ahead_copy for u in units), "a unit has no copy uploaded ahead"
    offload = units[-1].offload
    offload.host_copy.fill_(3.0)  # behind the weights' back: only the host copy says 3
    first = offload.gather_source()  # the forward's: the copy made ahead
    assert torch.equal(first, offload.weight.data.to(torch.bfloat16)), "the forward's gather skipped the copy ahead"
    assert torch.all(offload.gather_source() == 3.0), "the backward's gather did not send the host copy"
    with torch.no_grad():
        offload.weight.data.mul_(2.0)  # the weights moved on: the copy is stale
    got = offload.gather_source()
    assert got.dtype == offload.weight.data.dtype and torch.equal(got, offload.weight.data), "stale host copy sent"
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("count", [1, 3, 99], ids=["root", "three", "all"])
@pytest.mark.matrix(zero="optim_grads_params", offload="cpu_overlap", dtype="bf16")
def test_units_stepped_on_the_device_equal_the_host_step(count: int, dist_env) -> None:
    """device_step_units=N, params=True, bf16 compute, ZeRO-3: the first N units in forward order
    step on the device inside the overlapped step, the rest on the host; on CPU (the device is
    the host, same kernel) losses, params and state equal overlap_step=False bit for bit. Each
    device-stepped unit's copy for the next forward is its new weights' cast, and both paths ran."""
    device = dist_env.device
    runs = {}
    for units in (0, count):
        policy = dataclasses.replace(_overlap_policy("cpu", device, bool(units) or False), params=True,
                                     device_step_units=units)
        runs[units] = train("gpt", device, dict(zero_dp_strategy=3, offload_policy=policy), steps=4,
                            dtype=torch.bfloat16)
    _assert_identical(runs[count], runs[0], f"device_step_units={count}")
    model, opt = runs[count][2], runs[count][3]
    phases = opt.__dict__[OVERLAP_ATTR].last_times.phases
    assert phases.get("device_step", 0.0) > 0.0, "no unit stepped on the device"
    on_host = count < len(model._fsdp_engine.units)
    assert (phases.get("step", 0.0) > 0.0) == on_host, f"host steps: {phases}"
    for unit in model._fsdp_engine.units:
        ahead = unit.offload.ahead
        assert ahead is not None and torch.equal(ahead.tensor, unit.offload.weight.data.to(torch.bfloat16)), unit.name
    _no_worker_left()


def _gpt_inputs(device: torch.device) -> list[torch.Tensor]:
    inputs, _ = global_batch("gpt", 0, 2, torch.bfloat16)
    return [x.to(device) for x in inputs]

@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("step", ["cpu", "gpu"])
@pytest.mark.matrix(zero="optim_grads_params", model="mlp", offload=matrix.param("step", lambda s: f"{s}_overlap"))
def test_clip_mode_equals_clipping_without_overlap(step: str, dist_env) -> None:
    """overlap_step='clip' with clip_grad_norm before every step (TinyMLP: an empty shard on
    rank 1): the norms, losses, params and state equal the non-overlapped offloaded run's bit for
    bit (step='gpu': and no offload's), and the norms come from the ones made in the backward."""
    device = dist_env.device
    norms: dict[str, list[float]] = {}

    def clip(into: str) -> Any:
        def before_step(model: torch.nn.Module, opt: Any, step_index: int) -> None:
            norms.setdefault(into, []).append(float(fsdp_impl.clip_grad_norm(model, 0.05)))
        return before_step

    runs = {}
    with window(device):
        runs["none"] = train("tiny", device, dict(zero_dp_strategy=3), before_step=clip("none"))
        for mode in (False, "clip"):
            kwargs = dict(zero_dp_strategy=3, offload_policy=_overlap_policy(step, device, mode))
            runs[mode] = train("tiny", device, kwargs, before_step=clip(str(mode)))
    assert min(norms["False"]) > 0.05, "clipping must be active"
    assert norms["clip"] == norms["False"]
    _assert_identical(runs["clip"], runs[False], f"clip, step={step}")
    if step == "gpu":
        assert norms["clip"] == norms["none"]
        _assert_identical(runs["clip"], runs["none"], "clip vs no offload")
    times = runs["clip"][3].__dict__[OVERLAP_ATTR].last_times
    assert times.landed > 0 and times.norm_hits > 0, "the norms of the backward were not used"
    _no_worker_left()


# ---------------------------------------------------------------------------------- errors
def _wrap(device: torch.device, overlap: Any, step: str = "cpu", opt_cls: Any = torch.optim.Adam) -> tuple:
    module = build_model("cnn", seed=0)
    with window(device):
        return fsdp_impl.fully_shard(module, opt_cls(module.parameters(), lr=1e-2),
                                     fsdp_unit_modules=list(unit_classes("cnn")), zero_dp_strategy=3,
                                     offload_policy=_overlap_policy(step, device, overlap))


def _backward(model: torch.nn.Module, device: torch.device) -> None:
    gen = torch.Generator().manual_seed(dist.get_rank())
    model(torch.randn(2, 3, 8, 8, generator=gen).to(device)).square().mean().backward()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(zero="optim_grads_params", offload="cpu_overlap")
def test_the_worker_widens_only_where_the_caller_waits(dist_env) -> None:
    """step="cpu", overlap_step=True or "forward", step_threads=None: each optimizer.step() widens
    the worker to the caller's width (True: before waiting for it; "forward": the next forward's
    gathers wait for it); an explicit step_threads never widens. The numbers of both widened runs
    equal the non-overlapped run's."""
    from fsdp_impl.offload.worker import StepWorker
    device, calls = dist_env.device, []
    original = StepWorker.widen

    def spy(self: StepWorker, width: int) -> None:
        calls.append(width)
        original(self, width)
    runs = {}
    StepWorker.widen = spy  # type: ignore[method-assign]
    try:
        for name, overlap, extra in (("widened", True, {}), ("explicit", True, dict(step_threads=1)),
                                     ("forward", "forward", {}), ("off", False, {})):
            policy = dataclasses.replace(_overlap_policy("cpu", device, overlap), **extra)
            before = len(calls)
            runs[name] = train("gpt", device, dict(zero_dp_strategy=3, offload_policy=policy), steps=3)
            widens = name in ("widened", "forward")
            assert calls[before:] == ([torch.get_num_threads()] * 3 if widens else []), (name, calls)
    finally:
        StepWorker.widen = original  # type: ignore[method-assign]
    _assert_identical(runs["widened"], runs["off"], "widened worker")
    _assert_identical(runs["forward"], runs["off"], "widened \"forward\" worker")
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(zero="optim_grads_params", model="cnn", offload="cpu_overlap")
def test_overlap_refuses_what_it_cannot_keep_exact(dist_env) -> None:
    """Each misuse raises naming overlap_step, before silently wrong numbers: bad values, an
    optimizer it cannot step per unit, clip_grad_norm after an overlapped step, an lr changed
    between the backward and step(), a forward or zero_grad before step(); a worker error is
    re-raised by step(); no thread survives any of it."""
    device = dist_env.device
    for bad in ("yes", 1, None):
        allowed = r"\(False, True, 'clip', 'forward'\)"
        with pytest.raises(ValueError, match=r"OffloadPolicy\.overlap_step must be one of " + allowed):
            fsdp_impl.OffloadPolicy(step="cpu", pin_memory=False, overlap_step=bad)
    with pytest.raises(ValueError, match=r"overlap_step=True.*grads must be on the host"):
        fsdp_impl.OffloadPolicy(main_params=False, grads=False, pin_memory=False, overlap_step=True)
    with pytest.raises(ValueError, match=r"OffloadPolicy\(overlap_step=True\).*torch\.optim\.sgd\.SGD"):
        _wrap(device, True, opt_cls=torch.optim.SGD)

    model, opt = _wrap(device, True)
    _backward(model, device)
    with pytest.raises(RuntimeError, match=r"clip_grad_norm after a backward with OffloadPolicy\(overlap_step=True\)"
                                           r".*overlap_step='clip'"):
        fsdp_impl.clip_grad_norm(model, 1.0)
    opt.step()  # the refusal left the cycle for step() to consume
    opt.zero_grad()

    _backward(model, device)
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(RuntimeError, match=r"param group 0's \['lr'\] changed between the backward and "):
        opt.step()
    opt.param_groups[0]["lr"] = 1e-2
    opt.zero_grad()

    _backward(model, device)
    with pytest.raises(RuntimeError, match=r"a forward ran after a backward with OffloadPolicy\(overlap_step=True\)"):
        _backward(model, device)
    opt.zero_grad()
    _backward(model, device)
    with pytest.raises(RuntimeError, match=r"zero_grad\(\) ran after a backward with OffloadPolicy\(overlap_step="):
        opt.zero_grad()
    _no_worker_left()

    import fsdp_impl.offload.optim as offload_optim

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ArithmeticError("injected failure of a unit's host step")

    real = offload_optim.host_step_units
    offload_optim.host_step_units = broken
    try:
        _backward(model, device)
        with pytest.raises(ArithmeticError, match="injected failure"):
            opt.step()
    finally:
        offload_optim.host_step_units = real
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(zero="optim_grads_params", model="cnn", offload="cpu_overlap")
def test_clip_mode_accumulation_and_a_changed_grad(dist_env) -> None:
    """overlap_step='clip': a second sync backward without a step accumulates (no step ran);
    a grad changed in place after the backward is normed afresh, not from the stale norm."""
    device = dist_env.device
    results = {}
    for mode in (False, "clip"):
        torch.manual_seed(0)
        model, opt = _wrap(device, mode)
        _backward(model, device)
        _backward(model, device)  # accumulates into the host grads
        first = next(iter(model.parameters()))
        first.grad.to_local().mul_(3.0)  # after the backward: the cached norm of this grad is stale
        norm = fsdp_impl.clip_grad_norm(model, 1e-3)
        opt.step()
        results[mode] = (norm, {n: full_tensor(p) for n, p in model.named_parameters()})
    assert torch.equal(results["clip"][0], results[False][0])
    for name, value in results[False][1].items():
        assert torch.equal(results["clip"][1][name], value), name
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("variant", ["fsdp_adamw_decoupled_bf16", "torch_adam_bf16_grads_cast"])
@pytest.mark.parametrize("step", ["cpu", "gpu"])
@pytest.mark.matrix(zero="optim_grads_params", offload=matrix.param("step", lambda s: f"{s}_overlap"))
def test_overlap_with_narrow_grads(step: str, variant: str, dist_env) -> None:
    """bf16 main grads: read as decoupled grads by fsdp_impl.optim.AdamW with bf16 moments (its
    own kernel and state init), or as .grad by torch's Adam (a cast copy to the fp32 params,
    which the overlapped step must make from the host buffer as the installed grad is made):
    overlapped equals non-overlapped bit for bit, losses, params and state."""
    device = dist_env.device
    decoupled = variant.startswith("fsdp")

    def make_opt(module: torch.nn.Module) -> torch.optim.Optimizer:
        if decoupled:
            return fsdp_impl.optim.AdamW(module.parameters(), lr=1e-2, use_decoupled_grad=True,
                                         exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
        return torch.optim.Adam(module.parameters(), lr=1e-2)

    mp = fsdp_impl.MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16)
    runs = {}
    with window(device):
        for overlap in (False, True):
            kwargs = dict(zero_dp_strategy=3, use_decoupled_grad=decoupled, mixed_precision_policy=mp,
                          offload_policy=_overlap_policy(step, device, overlap))
            runs[overlap] = train("gpt", device, kwargs, steps=3, make_opt=make_opt)
    _assert_identical(runs[True], runs[False], f"{variant}, step={step}")
    assert runs[True][3].__dict__[OVERLAP_ATTR].last_times.landed > 0


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(zero="optim_grads_params", model="mlp", offload="cpu_overlap")
def test_two_models_share_one_overlapped_optimizer(dist_env) -> None:
    """Two wrapped models, one optimizer: model B's forward may run after model A's overlapped
    backward (its weights are not being written), the step waits for both backwards' units, and
    the result equals overlap_step=False bit for bit."""
    device = dist_env.device
    finals = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        nets = [torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)) for _ in range(2)]
        models = [fsdp_impl.fully_shard_model(net, fsdp_unit_modules=[torch.nn.Linear], zero_dp_strategy=3,
                                              offload_policy=_overlap_policy("cpu", device, overlap)) for net in nets]
        opt = fsdp_impl.fully_shard_optimizer(torch.optim.Adam([p for m in models for p in m.parameters()], lr=1e-2))
        gen = torch.Generator().manual_seed(7 + dist.get_rank())
        for _ in range(3):
            for model in models:
                model(torch.randn(4, 6, generator=gen).to(device)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        finals[overlap] = [full_tensor(p) for m in models for p in m.parameters()]
    for got, want in zip(finals[True], finals[False], strict=True):
        assert torch.equal(got, want)
    _no_worker_left()


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("style", ["inside", "wrapper_reentrant"])
@pytest.mark.matrix(zero="optim_grads_params", model="mlp", recompute=matrix.param("style"), offload="gpu_overlap")
def test_overlap_with_activation_recompute(style: str, dist_env) -> None:
    """Recompute re-gathers units from their host shards inside the backward (reentrant: in an
    inner backward) while earlier units already step: losses, every step's grads and the params
    equal the run with neither offload nor recompute."""
    from tests.functional.common.recompute import RecomputeBlock, assert_bit_identical, build_net
    from tests.functional.common.recompute import train as train_recompute
    device = dist_env.device
    records = {}
    hostall = fsdp_impl.OffloadPolicy(step="gpu", params=True, grads=True, chunk_bytes=4096,
                                      pin_memory=device.type == "cuda", overlap_step=True)
    for name, recompute, offload in (("plain", "none", None), ("both", style, hostall)):
        net = build_net(recompute)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        with window(device):
            model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[RecomputeBlock], zero_dp_strategy=3,
                                               offload_policy=offload)
            records[name] = train_recompute(model, opt, 3, 2, device)
    assert_bit_identical(records["both"], records["plain"], f"overlapped offload + recompute {style}")
    assert opt.__dict__[OVERLAP_ATTR].last_times.landed > 0


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("step", ["cpu", "gpu"])
@pytest.mark.matrix(zero="optim_grads_params", model="mlp", offload=matrix.param("step", lambda s: f"{s}_overlap"))
def test_frozen_params_in_the_optimizer(step: str, dist_env) -> None:
    """An optimizer over every param, one of them frozen (no grad, in no unit's trainable set):
    the overlapped run skips it as the optimizer does, and equals overlap_step=False bit for bit."""
    device = dist_env.device

    def make_opt(module: torch.nn.Module) -> torch.optim.Optimizer:
        module.inner.bias.requires_grad_(False)
        return torch.optim.Adam(module.parameters(), lr=1e-2)

    runs = {}
    with window(device):
        for overlap in (False, True):
            kwargs = dict(zero_dp_strategy=3, offload_policy=_overlap_policy(step, device, overlap))
            runs[overlap] = train("tiny", device, kwargs, steps=3, make_opt=make_opt)
    _assert_identical(runs[True], runs[False], f"frozen bias, step={step}")


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(zero="optim_grads_params", model="mlp", offload="cpu_overlap")
def test_units_start_at_the_end_when_grads_are_final_only_there(dist_env) -> None:
    """report_nan_in_param_grad checks every grad at the end of the backward (HSDP's outer
    all-reduce also comes last): no unit may start before, every unit starts then, and the
    result equals overlap_step=False bit for bit."""
    device = dist_env.device
    runs = {}
    for overlap in (False, True):
        kwargs = dict(zero_dp_strategy=3, report_nan_in_param_grad=True,
                      offload_policy=_overlap_policy("cpu", device, overlap))
        runs[overlap] = train("tiny", device, kwargs, steps=3)
    _assert_identical(runs[True], runs[False], "report_nan_in_param_grad")
    model, opt = runs[True][2], runs[True][3]
    times = opt.__dict__[OVERLAP_ATTR].last_times
    assert times.landed == 0 and times.at_end == len([u for u in model._fsdp_engine.units if u.grad is not None])
