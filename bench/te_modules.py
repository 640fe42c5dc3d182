"""TransformerEngine glue for the FP8 implementations (``bench.impls``) and the CUDA-graph bench:
the block linears as ``te.Linear`` with the bf16 model's weights, TE's recipes by name, and a
forward under ``te.autocast``. TE is imported only when one of these runs."""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

BLOCK_LINEARS = ("qkv", "proj", "fc1", "fc2")


class TeAutocast(nn.Module):
    """Runs the wrapped model's forward under ``te.autocast(recipe)`` (the backward follows it)."""

    def __init__(self, model: nn.Module, recipe: Any) -> None:
        super().__init__()
        self.model, self.recipe = model, recipe

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import transformer_engine.pytorch as te
        with te.autocast(recipe=self.recipe):
            return self.model(tokens)


class _CopyInit:
    """A TE ``init_method`` that starts the weight from the bf16 model's value, then lets go of
    it (TE keeps its init methods, which would keep the old weights alive)."""

    def __init__(self, source: torch.Tensor) -> None:
        self.source: torch.Tensor | None = source

    def __call__(self, weight: torch.Tensor) -> None:
        if self.source is None:
            raise RuntimeError("this init method copies its source once (build a fresh model instead)")
        with torch.no_grad():
            weight.copy_(self.source)
        self.source = None


def te_linears(module: nn.Module, recipe: Any, fp8_params: bool) -> None:
    """Swap each block's linears for ``te.Linear`` with the same weights and biases."""
    import transformer_engine.pytorch as te
    init = (te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True) if fp8_params
            else contextlib.nullcontext())
    with init:
        for block in module.blocks:  # type: ignore[union-attr]
            for name in BLOCK_LINEARS:
                old: nn.Linear = getattr(block, name)
                new = te.Linear(old.in_features, old.out_features, params_dtype=old.weight.dtype,
                                device=old.weight.device, init_method=_CopyInit(old.weight.detach()))
                with torch.no_grad():
                    new.bias.copy_(old.bias)
                setattr(block, name, new)


def te_recipe(kind: str) -> Any:
    from transformer_engine.common import recipe as r
    return {"current": r.Float8CurrentScaling, "delayed": r.DelayedScaling, "block": r.Float8BlockScaling}[kind]()
