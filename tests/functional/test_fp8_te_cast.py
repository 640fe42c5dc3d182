"""The current- and delayed-scaling requantisations of TE FP8 weights
(``fsdp_impl.fp8.te._quantize_current`` / ``_quantize_delayed``) write the same bytes, scale
inverses (and, delayed, amaxes) as TransformerEngine's own ``quantize_master_weights`` (whose cast
they replace for speed), for weights of several shapes and value ranges."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from fsdp_impl.fp8.te import _quantize_current, _quantize_delayed
from tests.functional import matrix_axes as axes

pytestmark = [pytest.mark.requires_cuda, pytest.mark.requires_module("transformer_engine"),
              pytest.mark.distributed(world_size=1),
              pytest.mark.matrix(mesh=axes.mesh(1), zero="optim_grads_params", model="te_linear", dtype="bf16",
                                 recipe=axes.recipe("current"))]


def _te_weight(rows: int, cols: int, delayed: bool = False) -> torch.Tensor:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

    with te.quantized_model_init(recipe=DelayedScaling() if delayed else Float8CurrentScaling()):
        return te.Linear(cols, rows, params_dtype=torch.bfloat16, device="cuda").weight


def _cast_like_te(cast: Any, ours: list[torch.Tensor], ref: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
    """``cast`` on ``ours`` and TE's ``quantize_master_weights`` on ``ref`` (each weight a whole
    shard at row 0), then the bytes and scale inverses compared weight by weight."""
    from transformer_engine.pytorch.tensor.utils import quantize_master_weights

    shape = tuple(masters[0].shape)
    outs = [torch.full(shape, 7, dtype=torch.uint8, device="cuda") for _ in masters]
    items = [SimpleNamespace(param=SimpleNamespace(tensor=w), shard=m, out=[o], row_start=0)
             for w, m, o in zip(ours, masters, outs, strict=True)]
    cast(items, dist.group.WORLD)
    quantize_master_weights(ref, [m.reshape(-1) for m in masters], [0] * len(masters), dist.group.WORLD,
                            fsdp_shard_model_weights=[w._data.view(-1) for w in ref],
                            manual_post_all_gather_processing=True)
    for i, (out, w, r) in enumerate(zip(outs, ours, ref, strict=True)):
        assert torch.equal(w._scale_inv, r._scale_inv), (i, w._scale_inv, r._scale_inv)
        assert torch.equal(out, r._data), f"weight {i}: {(out != r._data).sum().item()} bytes differ from TE's cast"
        assert out.count_nonzero() > 0


@pytest.mark.parametrize("shape,spread", [((256, 128), 1.0), ((512, 384), 1e-3), ((128, 1024), 300.0)])
def test_current_scaling_cast_equals_te(shape: tuple[int, int], spread: float, dist_env) -> None:
    gen = torch.Generator(device="cuda").manual_seed(shape[0])
    masters = [torch.randn(shape, device="cuda", generator=gen) * spread for _ in range(2)]
    masters[1][0, :7] = torch.tensor([0.0, -0.0, 1e-30, -1e30, 3.0e38, 448.0, -449.0])  # extremes
    _cast_like_te(_quantize_current, [_te_weight(*shape) for _ in masters], [_te_weight(*shape) for _ in masters],
                  masters)


@pytest.mark.matrix(recipe=axes.recipe("delayed"))
@pytest.mark.parametrize("shape,spread", [((256, 128), 1.0), ((512, 384), 1e-3), ((128, 1024), 300.0)])
def test_delayed_scaling_cast_equals_te(shape: tuple[int, int], spread: float, dist_env) -> None:
    """Scales set as a delayed-scaling history would leave them (the second weight's saturates its
    large values), amaxes holding an earlier value that the casts fold theirs into."""
    gen = torch.Generator(device="cuda").manual_seed(shape[1])
    masters = [torch.randn(shape, device="cuda", generator=gen) * spread for _ in range(2)]
    masters[1][0, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e30, 3.0e38])  # extremes (saturate)
    ours = [_te_weight(*shape, delayed=True) for _ in masters]
    ref = [_te_weight(*shape, delayed=True) for _ in masters]
    for pair, (scale, amax) in zip(zip(ours, ref, strict=True), ((448.0 / spread, 0.5), (3.0, 1e-3)), strict=True):
        for w in pair:
            w._get_quantizer().scale.fill_(scale)
            w._get_quantizer().amax.fill_(amax)
    _cast_like_te(_quantize_delayed, ours, ref, masters)
    for i, (w, r) in enumerate(zip(ours, ref, strict=True)):
        assert torch.equal(w._get_quantizer().amax, r._get_quantizer().amax), i
    # the cast folds the shard's amax into the held 0.5 (a max: the held value stays when larger)
    folded = max(0.5, masters[0].to(torch.bfloat16).abs().max().item())
    assert ours[0]._get_quantizer().amax.item() == folded, (ours[0]._get_quantizer().amax, folded)
