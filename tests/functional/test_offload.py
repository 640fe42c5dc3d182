"""CPU offload (``fully_shard(..., offload_policy=OffloadPolicy(...))``) against the same run
without offload, on gloo.

Every test trains a wrapped model twice, once with and once without offload, from the same init
on the same batches, and compares the numbers:

* ``step="gpu"`` runs the optimizer's own update (``torch.optim.adam.adam`` with the group's
  flags, or ``fsdp_impl.optim``'s path) on the chunks of the streamed window, so losses, params
  and optimizer state are **bit-identical** to no offload. On a CPU mesh the "device window" is
  host memory (``fsdp_impl._testing.STREAMED_STEP_ON_CPU``) but the chunking (several chunks
  per step, parameters split across chunks), the copies and the kernels are the GPU's.
* ``step="cpu"`` runs torch's fused CPU Adam where the non-offloaded CPU run uses the
  single-tensor loop: within ``CPU_STEP_RTOL`` (``common/offload.py`` says what was measured).

A missed copy (a chunk whose update never reaches host memory, grads not moved down, a compute
shard not refreshed after the step) shows as a loss or parameter difference of order lr = 1e-2.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import fsdp_impl
from fsdp_impl import checkpoint
from fsdp_impl._testing import GRAPH_MODE_ON_CPU
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.checkpointing import (
    K_SAVE,
    N_STEPS,
    Case,
    assert_same_state,
    full_state,
    probe_forward,
    train_step,
    train_with_checkpoint,
)
from tests.functional.common.mesh import full_params
from tests.functional.common.models import build_model, unit_classes
from tests.functional.common.numerics import assert_losses_close, model_relative_error
from tests.functional.common.offload import (
    CPU_STEP_RTOL,
    OFFLOAD_CASES,
    SAME_MATH,
    policy,
    train,
    window,
    wrap_case,
)
from tests.functional.common.recompute import RecomputeBlock, assert_bit_identical, build_net
from tests.functional.common.recompute import train as train_recompute

pytestmark = [pytest.mark.matrix(model="gpt", dtype="fp32")]
CASES = tuple(OFFLOAD_CASES)


def _compare(case: str, losses: list[float], ref_losses: list[float], final: dict[str, torch.Tensor],
             ref_final: dict[str, torch.Tensor], what: str) -> None:
    if case in SAME_MATH:
        assert losses == ref_losses, f"{what}: losses {losses} != no offload {ref_losses}"
        for name, value in ref_final.items():
            assert torch.equal(final[name], value), (
                f"{what}: {name} differs from no offload (max abs {(final[name] - value).abs().max().item():.3e})")
    else:
        assert_losses_close(losses, ref_losses, CPU_STEP_RTOL, f"{what} losses")
        err = model_relative_error(final, ref_final)
        assert err <= CPU_STEP_RTOL, f"{what}: params relative error {err:.3e} > {CPU_STEP_RTOL}"


def _streamed_chunks(opt: Any) -> int:
    runner = opt.__dict__.get("_fsdp_offload_step")
    return len(runner.core.last_plan) if runner is not None else 0


# ---------------------------------------------------------------------------------- parity
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("strategy", [0, 1, 2, 3], ids=["zero0", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.matrix(mesh=axes.mesh(2), zero=matrix.param("strategy", axes.zero), offload=matrix.param("case"))
def test_offload_matches_no_offload(case: str, strategy: int, dist_env) -> None:
    """Two microbatches per step (accumulation), fp32, the GPT with its tied embedding in the root."""
    device = dist_env.device
    ref_losses, ref_final, _, _ = train("gpt", device, dict(zero_dp_strategy=strategy))
    with window(device):
        losses, final, model, opt = train("gpt", device, dict(zero_dp_strategy=strategy,
                                                              offload_policy=policy(case, device)))
    _compare(case, losses, ref_losses, final, ref_final, f"{case}, ZeRO-{strategy}")
    if case in SAME_MATH:  # (overlapped: the last plan is one unit's)
        assert _streamed_chunks(opt) > (0 if "overlap" in case else 3), "the tiny chunk_bytes must cut the step"
    if "overlap" in case:
        times = opt.__dict__["_fsdp_offload_overlap"].last_times
        assert times.landed > 0 and times.landed + times.at_end == len(model._fsdp_engine.units)
    unit = model._fsdp_engine.units[0]
    fused_host_step = case.startswith("cpu") and all(g["fused"] for g in opt.param_groups)
    assert not case.startswith("cpu") or fused_host_step, "step='cpu' runs torch's fused CPU Adam"
    if OFFLOAD_CASES[case].get("main_params", True):
        assert unit.weight is not unit.group.main_grad_buffer and unit.offload is not None
        assert unit.offload.compute_shard is None or unit.offload.compute_shard.dtype == torch.float32


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("case", ["gpu", "cpu"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", dtype="bf16", offload=matrix.param("case"))
def test_offload_bf16_compute_fp32_main(case: str, dist_env) -> None:
    """bf16 compute with fp32 main params: the device compute shard holds the bf16 cast."""
    device = dist_env.device
    kwargs: dict[str, Any] = dict(zero_dp_strategy=3,
                                  mixed_precision_policy=fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32))
    ref_losses, ref_final, _, _ = train("gpt", device, kwargs, dtype=torch.bfloat16)
    with window(device):
        losses, final, model, _ = train("gpt", device, dict(kwargs, offload_policy=policy(case, device)),
                                        dtype=torch.bfloat16)
    _compare(case, losses, ref_losses, final, ref_final, f"{case}, bf16")
    shard = model._fsdp_engine.units[0].offload.compute_shard
    assert shard is not None and shard.dtype == torch.bfloat16


@pytest.mark.distributed(world_size=4, timeout=300)
@pytest.mark.parametrize("outer", ["no_shard", "optim"])
@pytest.mark.parametrize("case", ["gpu", "cpu"])
@pytest.mark.matrix(mesh=axes.mesh(2, outer=2), zero="optim_grads_params", outer=matrix.param("outer"),
                    model="cnn", offload=matrix.param("case"))
def test_offload_hsdp(case: str, outer: str, dist_env) -> None:
    """HSDP (outer no_shard: the grads' dp_outer all-reduce runs before they move to the host) and
    HFSDP (outer optim: two-level reduce-scatter)."""
    device = dist_env.device
    from tests.functional.common.offload import hsdp_kwargs
    kwargs = dict(zero_dp_strategy=3, **hsdp_kwargs(outer, device))
    ref_losses, ref_final, _, _ = train("cnn", device, kwargs, steps=4)
    with window(device):
        losses, final, _, _ = train("cnn", device, dict(kwargs, offload_policy=policy(case, device)), steps=4)
    _compare(case, losses, ref_losses, final, ref_final, f"{case}, outer {outer}")


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("style", ["inside", "wrapper"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="mlp", recompute=matrix.param("style"),
                    offload="gpu_host_all")
def test_offload_with_activation_recompute(style: str, dist_env) -> None:
    """Recompute re-gathers a unit from its host shard inside the backward: with offload and
    recompute, losses, every step's grads and the params equal the run with neither."""
    device = dist_env.device
    records = {}
    for name, recompute, offload in (("plain", "none", None), ("both", style, policy("gpu_host_all", device))):
        net = build_net(recompute)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        with window(device):
            model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[RecomputeBlock], zero_dp_strategy=3,
                                               offload_policy=offload)
            records[name] = train_recompute(model, opt, 3, 2, device)
    assert_bit_identical(records["both"], records["plain"], f"offload + recompute {style}")


# ------------------------------------------------------------- decoupled grads, clipping
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("case", ["gpu", "gpu_host_all", "cpu"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", offload=matrix.param("case"))
def test_offload_decoupled_grads_bf16_moments(case: str, dist_env) -> None:
    """fsdp_impl.optim.AdamW with decoupled bf16 grads and bf16 moments (the precision-aware
    path): the streamed state keeps its bf16 dtype and the update is the optimizer's own."""
    device = dist_env.device

    def make_opt(module: torch.nn.Module) -> torch.optim.Optimizer:
        return fsdp_impl.optim.AdamW(module.parameters(), lr=1e-2, use_decoupled_grad=True,
                                     exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)

    kwargs: dict[str, Any] = dict(zero_dp_strategy=3, use_decoupled_grad=True,
                                  mixed_precision_policy=fsdp_impl.MixedPrecisionPolicy(main_grads_dtype=torch.bfloat16))
    ref_losses, ref_final, _, _ = train("gpt", device, kwargs, make_opt=make_opt)
    with window(device):
        losses, final, model, opt = train("gpt", device, dict(kwargs, offload_policy=policy(case, device)),
                                          make_opt=make_opt)
    # step='cpu' keeps this optimizer's own (single-tensor) path: bf16 moments cannot use the fused kernel
    assert all(g["fused"] is None for g in opt.param_groups)
    _compare("gpu" if case == "cpu" else case, losses, ref_losses, final, ref_final, f"{case}, decoupled")
    states = [opt.state[p] for p in model.parameters() if p in opt.state]
    assert states and all(s["exp_avg"].dtype == torch.bfloat16 for s in states)


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("case", ["gpu", "gpu_host_all", "cpu"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="mlp", offload=matrix.param("case"))
def test_offload_clip_grad_norm_with_empty_shards(case: str, dist_env) -> None:
    """clip_grad_norm over grads on the device or in host memory, with a parameter whose shard
    is empty on rank 1 (``TinyMLP.head``): the norms equal no offload's bit for bit (the same
    partial sums on the same CPU), and so does training with clipping (step='cpu': tolerance)."""
    device = dist_env.device
    norms: dict[str, list[float]] = {"ref": [], "off": []}

    def clip(into: str) -> Any:
        def before_step(model: torch.nn.Module, opt: Any, step: int) -> None:
            norms[into].append(float(fsdp_impl.clip_grad_norm(model, 0.05)))
        return before_step

    ref_losses, ref_final, _, _ = train("tiny", device, dict(zero_dp_strategy=3), before_step=clip("ref"))
    with window(device):
        losses, final, model, _ = train("tiny", device, dict(zero_dp_strategy=3, offload_policy=policy(case, device)),
                                        before_step=clip("off"))
    head = model._fsdp_engine.units[1]
    assert head.params[0].sharded_local().numel() == (8 if dist.get_rank() == 0 else 0)
    assert min(norms["ref"]) > 0.05, "clipping must be active"
    if case in SAME_MATH:
        assert norms["off"] == norms["ref"]
    else:
        assert norms["off"][0] == norms["ref"][0]  # same grads before the first (different) update
    _compare(case, losses, ref_losses, final, ref_final, f"{case}, clipped")


# ------------------------------------------------------------------------- host grads
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads", model="cnn", offload="gpu_host_all")
def test_host_grads_keep_zero_grad_and_accumulation_semantics(dist_env) -> None:
    """grads=True: ``.grad`` are views of a host buffer and the device grad buffer is freed after
    the sync backward; ``zero_grad(set_to_none=False)`` shows zeros; two backwards without a
    ``zero_grad`` add up exactly as without offload."""
    device = dist_env.device
    grads: dict[str, list[dict[str, torch.Tensor]]] = {}
    for name, kwargs in (("ref", {}), ("off", dict(offload_policy=policy("gpu_host_all", device)))):
        module = build_model("cnn", seed=0)
        opt = torch.optim.Adam(module.parameters(), lr=1e-2)
        with window(device):
            model, opt = fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=list(unit_classes("cnn")),
                                               zero_dp_strategy=2, **kwargs)
        gen = torch.Generator().manual_seed(dist.get_rank())
        x = torch.randn(2, 3, 8, 8, generator=gen).to(device)
        snaps = []
        for _ in range(2):  # no zero_grad in between: the second backward accumulates
            model(x).square().mean().backward()
            snaps.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        grads[name] = snaps
        if name == "off":
            unit = model._fsdp_engine.units[0]
            assert unit.offload.host_grad is not None and not unit.grad.is_allocated
            p = unit.trainable[0].sharded
            host = unit.offload.host_grad.data.untyped_storage().data_ptr()
            assert p.grad.to_local().untyped_storage().data_ptr() == host
            opt.zero_grad(set_to_none=False)
            assert all(float(q.grad.to_local().abs().sum()) == 0 for q in model.parameters())
    for ref, off in zip(grads["ref"], grads["off"], strict=True):
        for n in ref:
            assert torch.equal(ref[n], off[n]), f"grad of {n} differs with host grads"


# ---------------------------------------------------------------------------- checkpoints
ROUND_TRIPS = [(None, "gpu"), ("gpu", None), ("gpu", "gpu_host_all"), ("cpu", "cpu"), ("gpu_state_only", "cpu"),
               ("cpu", "cpu_overlap"), ("gpu_overlap", "gpu")]


def _host_step(offload: str | None) -> bool:
    """Whether the case steps with torch's fused host Adam (step='cpu', overlapped or not)."""
    return offload is not None and offload.startswith("cpu")


def _name(offload: str | None) -> str:
    return offload or "none"


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("saved,loaded", ROUND_TRIPS, ids=[f"{_name(a)}-to-{_name(b)}" for a, b in ROUND_TRIPS])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim", model="transformer", offload=lambda p: _name(p["loaded"]))
def test_checkpoint_round_trip(saved: str | None, loaded: str | None, dist_env, tmp_path_factory) -> None:
    """Save during an offloaded (or plain) run, load into a fresh plain (or offloaded) wrap that
    already ran a forward from another init, train on: the state right after the load equals the
    saved one bit for bit, and the continuation equals the uninterrupted run (bit for bit when
    both sides run the same math; a switch to or from step='cpu''s fused host Adam: tolerance)."""
    device, case = dist_env.device, Case("transformer", "optim")
    root = _shared_dir(tmp_path_factory, f"{_name(saved)}-{_name(loaded)}")
    with window(device):
        model, opt = wrap_case(case, device, 0, saved)
        record = train_with_checkpoint(case, model, opt, device, root / "ckpt")
        del model, opt
        model, opt = wrap_case(case, device, 1234, loaded, lr=0.5)
        probe_forward(model, case.model, device)
        checkpoint.load(root / "ckpt", model, opt)
        assert_same_state(full_state(model, opt), record["at_save"], None, "right after load")
        losses = [train_step(model, opt, case.model, s, device) for s in range(K_SAVE, N_STEPS)]
    exact = _host_step(saved) == _host_step(loaded)
    if exact:
        assert losses == record["losses"][K_SAVE:]
        assert_same_state(full_state(model, opt), record["final"], None, "after resumed training")
    else:
        assert_losses_close(losses, record["losses"][K_SAVE:], CPU_STEP_RTOL, "resumed losses")
        assert_same_state(full_state(model, opt), record["final"], CPU_STEP_RTOL * 10, "after resumed training")


def _shared_dir(factory: Any, name: str) -> Path:
    """One directory for all ranks (rank 0 picks it)."""
    picked = [str(factory.mktemp(f"offload-{name}")) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(picked, src=0)
    return Path(str(picked[0]))


# ------------------------------------------------------------------------------ meta init
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.parametrize("case", ["gpu", "cpu"])
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", offload=matrix.param("case"))
def test_offload_meta_init_equals_eager_init(case: str, dist_env) -> None:
    """Meta-device init materialises each unit and copies its shard into host memory: the same
    params as an eager build, and the same first steps."""
    device = dist_env.device
    results = {}
    for meta in (False, True):
        with window(device):
            module = build_model("gpt", seed=0, device="meta" if meta else None)
            opt = torch.optim.Adam(module.parameters(), lr=1e-2)
            model, opt = fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=list(unit_classes("gpt")),
                                               init_model_with_meta_device=meta, offload_policy=policy(case, device))
            init = full_params(model)
            losses = [train_step(model, opt, "gpt", s, device) for s in range(2)]
        results[meta] = (init, losses)
    for name, value in results[False][0].items():
        assert torch.equal(results[True][0][name], value), f"{name}: meta init differs from eager init"
    assert results[True][1] == results[False][1]


# ---------------------------------------------------------------------------------- errors
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="cnn", offload="gpu")
def test_offload_errors_name_the_field(dist_env) -> None:
    """Each bad input fails at wrap time, on every rank, naming what to change."""
    device = dist_env.device

    def wrap(opt_cls: Any = torch.optim.Adam, **kwargs: Any) -> Any:
        module = build_model("cnn", seed=0)
        return fsdp_impl.fully_shard(module, opt_cls(module.parameters(), lr=1e-2),
                                     fsdp_unit_modules=list(unit_classes("cnn")), **kwargs)

    if device.type == "cpu":
        with pytest.raises(ValueError, match=r"offload_policy\.step='gpu' streams the optimizer state through a CUDA"):
            wrap(offload_policy=fsdp_impl.OffloadPolicy(pin_memory=False))
        with pytest.raises(ValueError, match=r"offload_policy\.pin_memory=True needs page-locked host memory"):
            wrap(offload_policy=fsdp_impl.OffloadPolicy(step="cpu"))
    with window(device), pytest.raises(ValueError, match=r"OffloadPolicy\(step='gpu'\).*torch\.optim\.sgd\.SGD"):
        wrap(torch.optim.SGD, offload_policy=policy("gpu", device))
    with pytest.raises(TypeError, match="offload_policy must be a fsdp_impl.OffloadPolicy or None"):
        wrap(offload_policy={"step": "cpu"})
    with GRAPH_MODE_ON_CPU.on(), pytest.raises(ValueError, match="offload_policy cannot be combined with cuda_graph"):
        module = build_model("cnn", seed=0)
        fsdp_impl.fully_shard(module, torch.optim.Adam(module.parameters(), lr=1e-2, capturable=True),
                              fsdp_unit_modules=list(unit_classes("cnn")), cuda_graph_mode=True,
                              offload_policy=policy("cpu", device))
    mine = policy("cpu" if dist.get_rank() == 0 else "gpu", device)
    with window(device), pytest.raises(ValueError, match=r"(?s)different arguments.*offload_policy differs"):
        wrap(offload_policy=mine)


# ------------------------------------------------------------------ the streaming window
@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", offload="gpu")
def test_oversized_chunk_bytes_trains_like_no_offload(dist_env) -> None:
    """chunk_bytes=2**50 used to make the first step ask the allocator for 3 x 2**50 bytes; the
    window now holds one chunk of exactly what the step streams (a chunk never exceeds it), and
    the run is bit-identical to no offload."""
    device = dist_env.device
    ref_losses, ref_final, _, _ = train("gpt", device, dict(zero_dp_strategy=3))
    big = fsdp_impl.OffloadPolicy(step="gpu", chunk_bytes=2**50, pin_memory=device.type == "cuda")
    with window(device):
        losses, final, model, opt = train("gpt", device, dict(zero_dp_strategy=3, offload_policy=big))
    _compare("gpu", losses, ref_losses, final, ref_final, "chunk_bytes=2**50")
    core = opt.__dict__["_fsdp_offload_step"].core
    streamed = sum(p.to_local().numel() for p in model.parameters()) * 16  # param, grad, 2 moments: fp32
    assert len(core.last_plan) == 1 and core.last_window_bytes == streamed


@pytest.mark.distributed(world_size=2, timeout=300)
@pytest.mark.matrix(mesh=axes.mesh(2), zero="optim_grads_params", model="cnn", offload="gpu")
def test_window_that_cannot_fit_is_refused_at_wrap_time(dist_env, monkeypatch) -> None:
    """A window larger than one rank's free memory is refused at wrap time on every rank with
    the same error (the other rank must not wait in the wrap's next collective), naming
    OffloadPolicy.chunk_bytes, the bytes needed on that rank and its free bytes; the module is
    left as it was. Here rank 1 reports 1000 free bytes."""
    import fsdp_impl.offload.host as offload
    device, rank = dist_env.device, dist.get_rank()
    free = 1000
    real = offload.free_memory
    monkeypatch.setattr(offload, "free_memory", lambda d: free if rank == 1 else real(d))
    module = build_model("cnn", seed=0)
    params = [(p, p.detach().clone()) for p in module.parameters()]
    # independent count: rank 1's torch.chunk rows of every param (all trainable), one chunk
    # (the default 64 MiB is more than the model), 4 bytes of param + 4 of grad + at least
    # 1 + 1 of the two moments (the narrowest a streamed Adam may keep) per element
    needed = sum(torch.chunk(p.detach(), 2)[1].numel() if len(torch.chunk(p.detach(), 2)) > 1 else 0
                 for p in module.parameters()) * 10
    assert needed > free
    with window(device), pytest.raises(ValueError, match=rf"^OffloadPolicy\.chunk_bytes=67108864 needs a streaming "
                                                         rf"window of {needed} bytes .* only {free} bytes .* are free "
                                                         r"on rank 1; pass a smaller OffloadPolicy\.chunk_bytes$"):
        fsdp_impl.fully_shard(module, torch.optim.Adam(module.parameters(), lr=1e-2),
                              fsdp_unit_modules=list(unit_classes("cnn")),
                              offload_policy=fsdp_impl.OffloadPolicy(pin_memory=device.type == "cuda"))
    assert [p for p, _ in params] == list(module.parameters())
    assert all(type(p) is torch.nn.Parameter and torch.equal(p, value) for p, value in params)
