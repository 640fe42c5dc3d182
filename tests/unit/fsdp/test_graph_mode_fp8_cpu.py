"""FP8 parameters in CUDA-graph mode, run eagerly on CPU/gloo (2 ranks): what a captured FP8 step
does differently from a normal one, checked on every CI run (the captures themselves are
``tests/functional/test_cuda_graph_fp8.py``, GPU only).

Graph mode requantises every FP8 unit in every root pre-forward (no version-counter agreement:
a replay cannot decide on the host), refreshes ZeRO-2's compute params every forward and keeps
the engine buffers persistent. Checked: torch-native FP8 parameters (current, delayed and
blockwise recipes; ZeRO-3 with and without the transpose cache, ZeRO-2) train bit for bit like
the normal engine, over accumulation cycles, with uneven and empty shards (the 3-row head).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import fsdp_impl
from fsdp_impl._testing import GRAPH_MODE_ON_CPU
from fsdp_impl.fp8.params import ModelFp8
from tests.functional.common import fp8_training as ft

pytestmark = pytest.mark.distributed(world_size=2, timeout=300)

CPU = torch.device("cpu")
STEPS, MICROBATCHES = 3, 2


def _wrap(recipe: str, strategy: int, keep: bool, graph_mode: bool):
    module = ft.build(recipe)
    opt = fsdp_impl.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.01, capturable=True)
    policy = fsdp_impl.MixedPrecisionPolicy(main_params_dtype=torch.float32)
    with GRAPH_MODE_ON_CPU.on():
        return fsdp_impl.fully_shard(module, opt, fsdp_unit_modules=[ft.Fp8Block], zero_dp_strategy=strategy,
                                     mixed_precision_policy=policy, keep_fp8_transpose_cache=keep,
                                     cuda_graph_mode=graph_mode)


def _train(model, opt) -> list[torch.Tensor]:
    losses = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=False)
        for m in range(MICROBATCHES):
            model.set_model_auto_sync(m == MICROBATCHES - 1)
            x, y = ft.batch(step, dist.get_rank(), m)
            loss = F.mse_loss(model(x).float(), y)
            loss.backward()
            losses.append(loss.detach())
        opt.step()
    return losses


@pytest.mark.parametrize("recipe,strategy,keep", [
    ("current", 3, True), ("current", 3, False), ("current", 2, False),
    ("delayed", 3, True), ("blockwise", 3, True), ("blockwise", 2, False),
])
def test_fp8_graph_mode_trains_like_normal_mode(recipe: str, strategy: int, keep: bool, monkeypatch,
                                                dist_env) -> None:
    requantized: list[int] = []
    original = ModelFp8.requantize

    def counting(self: ModelFp8, units) -> None:
        requantized.append(sum(u.fp8 is not None for u in units))
        original(self, units)

    monkeypatch.setattr(ModelFp8, "requantize", counting)
    results = []
    for graph_mode in (False, True):
        requantized.clear()
        model, opt = _wrap(recipe, strategy, keep, graph_mode)
        losses = _train(model, opt)
        results.append((losses, ft.full_params(model), list(requantized)))
    (ref_losses, ref_params, ref_counts), (losses, params, counts) = results
    fp8_units = max(ref_counts)
    assert fp8_units > 0, "no FP8 unit was ever requantised"
    # Normal mode: only after an optimizer step (the first forward of each cycle, plus the very
    # first forward); graph mode: every forward, whatever changed.
    assert counts == [fp8_units] * (STEPS * MICROBATCHES), counts
    assert ref_counts == [fp8_units if m == 0 else 0 for _ in range(STEPS) for m in range(MICROBATCHES)], ref_counts
    for k, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert torch.equal(a, b), f"forward {k}: graph-mode loss {a.item()!r} != normal {b.item()!r}"
    bad = [n for n in ref_params if not torch.equal(params[n], ref_params[n])]
    assert not bad, f"graph mode vs normal: main params differ: {bad}"
