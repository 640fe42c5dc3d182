"""TransformerEngine FP8 helpers shared by the GPU suites (TE is imported only inside functions,
so the modules collect without it): recipes by name, the TE model of ``test_fp8_te.py`` (two
``te.LayerNormMLP`` units and a ``te.Linear`` head, bf16), its data, and the owned-shard grad check."""
from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl.placement import local_tensor

HIDDEN, FFN, TOKENS = 128, 256, (4, 32)  # FP8 GEMMs want dims and token counts in multiples of 16


def te_recipe(name: str) -> Any:
    """The TE recipe, or skip with TE's own reason when this GPU cannot run it."""
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as r
    check, make = {
        "delayed": (te.is_fp8_available, r.DelayedScaling),
        "current": (te.is_fp8_available, r.Float8CurrentScaling),
        "block": (te.is_fp8_block_scaling_available, r.Float8BlockScaling),
        "mxfp8": (te.is_mxfp8_available, lambda: r.MXFP8BlockScaling(fp8_format=r.Format.HYBRID)),
        "nvfp4": (te.is_nvfp4_available, r.NVFP4BlockScaling),
    }[name]
    available, reason = check(return_reason=True)
    if not available:
        pytest.skip(f"TransformerEngine cannot run {name} here: {reason}")
    return make()


def assert_grads_on_owned_shards(model: nn.Module, attr: str = "grad") -> None:
    for name, p in model.module.named_parameters():
        grad = getattr(p, attr)
        assert grad is not None, f"{name}: no {attr} after the sync backward"
        local = local_tensor(grad)
        if local.numel():
            assert local.count_nonzero() > 0, f"{name}: all-zero {attr} on rank {dist.get_rank()}"


class TeNet(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        import transformer_engine.pytorch as te
        self.blocks = nn.ModuleList([te.LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16, device=device)
                                     for _ in range(2)])
        self.head = te.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def build_te(recipe: Any, fp8_params: bool, meta: bool = False, seed: int = 0) -> nn.Module:
    import transformer_engine.pytorch as te
    torch.manual_seed(seed)
    torch.cuda.manual_seed(seed)
    init = (te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True) if fp8_params
            else contextlib.nullcontext())
    with init:
        return TeNet("meta" if meta else "cuda")


def te_batch(step: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + slot)
    x = torch.randn(*TOKENS, HIDDEN, generator=gen)
    return x.to("cuda", torch.bfloat16), torch.randn(*TOKENS, HIDDEN, generator=gen).cuda()


def unit_classes() -> list[type]:
    import transformer_engine.pytorch as te
    return [te.LayerNormMLP]
