"""Activation recompute on the GPU (skips elsewhere naming CUDA or TransformerEngine): CUDA-graph
capture and replay of a step with recompute, TransformerEngine FP8 parameters recomputed, and
the memory recompute saves against its closed form. ``test_activation_recompute.py`` has the
CPU/gloo matrix; every check here compares numbers with the same model without recompute.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_impl
from fsdp_impl.cuda_graph import capture_train_step
from harness import matrix
from tests.functional import matrix_axes as axes
from tests.functional.common.graph_training import (
    GraphCase,
    assert_params_equal,
    batch,
    full_params,
    make_step_fn,
    warmup_then_steps,
    wrap,
)
from tests.functional.common.recompute import RecomputeBlock, build_net
from tests.functional.common.te_fp8 import te_recipe

pytestmark = [pytest.mark.requires_cuda, pytest.mark.distributed(world_size=1, timeout=600)]

WARMUP, STEPS = 3, 6


@pytest.mark.parametrize("strategy", [1, 3])
@pytest.mark.parametrize("pool", [False, True], ids=["persistent", "pool"])
@pytest.mark.matrix(mesh=axes.mesh(1), zero=matrix.param("strategy", axes.zero), model="graph_net", dtype="fp32",
                    graph="cuda_graph", recompute="inside")
def test_recompute_cuda_graph_replay(strategy: int, pool: bool, dist_env: Any) -> None:
    """``capture_train_step`` captures a step whose blocks recompute inside their forward; the
    replays train bit for bit like eager with recompute, which trains like eager without."""
    if pool and strategy != 3:
        pytest.skip("the unshard pool is a ZeRO-3 storage")
    case, device = GraphCase(strategy), dist_env.device
    warm = batch(0, device, case.dtype)
    batches = [batch(k + 1, device, case.dtype) for k in range(STEPS)]
    runs: dict[Any, Any] = {}
    for recompute in (False, True):
        model, opt = wrap(case, device, graph_mode=True, recompute=recompute, fsdp_double_buffer=pool)
        runs[recompute] = (warmup_then_steps(opt, make_step_fn(model), warm, WARMUP, batches), full_params(model))
    model, opt = wrap(case, device, graph_mode=True, recompute=True, fsdp_double_buffer=pool)
    static = tuple(t.clone() for t in warm)
    captured = capture_train_step(model, opt, make_step_fn(model), static, warmup=WARMUP)
    replayed = []
    for b in batches:
        captured.copy_inputs(*b)
        replayed.append(captured.replay().detach().clone())
    runs["replay"] = (replayed, full_params(model))
    for what, (losses, params) in (("eager recompute", runs[True]), ("replayed recompute", runs["replay"])):
        assert torch.equal(torch.stack(losses), torch.stack(runs[False][0])), f"{what}: losses differ from no recompute"
        assert_params_equal(params, runs[False][1], f"{what} vs no recompute")


# -------------------------------------------------------------------------------- memory
# Closed form, per block of RecomputeBlock without recompute (T tokens, compute dtype of b bytes):
# norm0 saves its input x, proj its input norm0(x), norm its input h, fc1 its input norm(h), gelu
# its input fc1(.) (T x H), fc2 its input gelu(.) (T x H): T(4D + 2H) elements (LayerNorm's fp32
# mean/rstd, 2T floats, ignored). A block checkpointed whole keeps only its input x (T x D) from
# the forward to its backward: S = L * T * (3D + 2H) * b bytes are not kept. The backward then
# rematerialises one block at a time (T(4D + 2H) b) and its MLP backward holds two T x H
# temporaries (the grads of gelu's output and input, 2 T H b) next to them, so the peak drops by
# at least S - T(4D + 2H) b - 2 T H b. Measured on one H200 (bf16, D 1024, H 4096, L 8, T 8192):
# 3070.2 -> 1905.5 MiB, a drop of 1164.7 MiB against a bound of 1088 MiB (S alone is 1408 MiB).
MEM = dict(d=1024, hidden=4096, layers=8, batch=8, seq=1024)


def _peak_step_bytes(style: str, device: torch.device) -> tuple[int, list[float]]:
    """Peak allocated bytes of one forward+backward (after a warm-up step), and the losses."""
    net = build_net(style, layers=MEM["layers"], d=MEM["d"], hidden=MEM["hidden"], dtype=torch.bfloat16)
    net = net.to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-4)
    model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[RecomputeBlock], zero_dp_strategy=3,
                                       mixed_precision_policy=fsdp_impl.MixedPrecisionPolicy(
                                           main_params_dtype=torch.float32))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(MEM["batch"], MEM["seq"], 3, generator=gen).to(device, torch.bfloat16)
    y = torch.randn(MEM["batch"], MEM["seq"], 2, generator=gen).to(device)
    losses, peak = [], 0
    for step in range(3):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = F.mse_loss(model(x).float(), y)
        loss.backward()
        torch.cuda.synchronize(device)
        if step == 1:
            peak = torch.cuda.max_memory_allocated(device)
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    del model, opt, net
    torch.cuda.empty_cache()
    return peak, losses


@pytest.mark.matrix(mesh=axes.mesh(1), zero="optim_grads_params", model="recompute_mlp", dtype="bf16",
                    recompute="wrapper")
def test_recompute_peak_memory_drops_by_the_saved_activations(dist_env: Any) -> None:
    device = dist_env.device
    peak_none, losses_none = _peak_step_bytes("none", device)
    peak_wrap, losses_wrap = _peak_step_bytes("wrapper", device)
    tokens, d, h = MEM["batch"] * MEM["seq"], MEM["d"], MEM["hidden"]
    saved = (MEM["layers"] * tokens * (3 * d + 2 * h) - tokens * (4 * d + 2 * h) - 2 * tokens * h) * 2
    drop = peak_none - peak_wrap
    print(f"[recompute memory] peak without {peak_none / 2**20:.1f} MiB, with {peak_wrap / 2**20:.1f} MiB, "
          f"drop {drop / 2**20:.1f} MiB, closed form >= {saved / 2**20:.1f} MiB")
    assert losses_wrap == losses_none, f"losses with recompute {losses_wrap} != without {losses_none}"
    assert drop >= saved, f"peak dropped by {drop / 2**20:.1f} MiB, closed form {saved / 2**20:.1f} MiB"


# ---------------------------------------------------------------------- TransformerEngine FP8
class TeBlock(nn.Module):
    """A unit holding a ``te.LayerNormMLP``, recomputed inside the unit's forward when asked,
    through TE's own ``te.distributed.checkpoint``: the recompute runs in the backward, outside
    ``te.autocast``, and TE's checkpoint restores the forward's FP8 state for it (with
    ``torch.utils.checkpoint`` the recompute would quantise with no recipe, or the default one:
    "A different number of tensors was saved", or a block-scaled weight against a delayed-scaling
    input, measured on the H200 with TE 2.20.2)."""

    def __init__(self, recompute: bool) -> None:
        super().__init__()
        import transformer_engine.pytorch as te
        self.recompute = recompute
        self.mlp = te.LayerNormMLP(128, 256, params_dtype=torch.bfloat16, device="cuda")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute:
            import transformer_engine.pytorch as te
            return x + te.distributed.checkpoint(self.mlp, x, use_reentrant=False)
        return x + self.mlp(x)


class TeRecomputeNet(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TeBlock(recompute) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _te_losses(recipe: Any, recompute: bool, zero: int, keep: bool, device: torch.device) -> list[float]:
    import transformer_engine.pytorch as te
    torch.manual_seed(0)
    torch.cuda.manual_seed(0)
    with te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True):
        net = TeRecomputeNet(recompute)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    model, opt = fsdp_impl.fully_shard(net, opt, fsdp_unit_modules=[TeBlock], zero_dp_strategy=zero,
                                       keep_fp8_transpose_cache=keep,
                                       mixed_precision_policy=fsdp_impl.MixedPrecisionPolicy(
                                           main_params_dtype=torch.float32))
    losses = []
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(4, 32, 128, generator=gen).to(device, torch.bfloat16)
        y = torch.randn(4, 32, 128, generator=gen).to(device)
        with te.autocast(recipe=recipe):
            out = model(x)
        loss = F.mse_loss(out.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item())
    return losses


@pytest.mark.requires_module("transformer_engine")
@pytest.mark.parametrize("keep", [False, True], ids=["regather", "keep"])
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("recipe", ["current", "block"])
@pytest.mark.matrix(mesh=axes.mesh(1), zero=matrix.param("zero", axes.zero), model="te_net", dtype="bf16",
                    recipe=matrix.param("recipe", axes.recipe), recompute="inside")
def test_recompute_te_fp8_params(recipe: str, zero: int, keep: bool, dist_env: Any) -> None:
    """TE FP8 parameters recomputed inside their unit train bit for bit like no recompute (the
    recompute uses the forward's FP8 bytes and scales; with ``keep_fp8_transpose_cache`` under
    ZeRO-3 the engine gathers the row-wise bytes the backward gather skipped)."""
    r = te_recipe(recipe)
    want = _te_losses(r, False, zero, keep, dist_env.device)
    got = _te_losses(r, True, zero, keep, dist_env.device)
    assert got == want, f"losses with recompute {got} != without {want}"
