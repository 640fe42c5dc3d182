"""``Float8Linear``: an ``nn.Linear`` whose three GEMMs run in FP8, and ``convert_to_fp8``.

Forward ``y = x W^T``, backward ``dx = dy W`` and ``dW = dy^T x``; every operand is quantised
by the module's per-role quantizers with its contraction dim last, so a block of 1 x 128 always
runs along the dim being summed (for ``dW`` that is the token dim, so activations and grads are
quantised a second time, transposed, when the recipe is blockwise; tensorwise recipes reuse the
transposed bytes with the same scale). Outputs and grads are in the input's / weight's dtype.

The weight comes from one of two places:

* ``module.weight`` (high precision), quantised on every forward (the plain, unsharded path);
* ``module.fp8_weight_slot`` when a sharding engine has filled it with the full FP8 weight it
  gathered as bytes: forward and backward read only the slot, so ``module.weight``'s storage may
  stay freed; autograd still delivers ``dW`` to ``module.weight``.

``fp8_params=True`` (``convert_to_fp8(..., fp8_params=True)``) declares the weight an *FP8
parameter*: a sharding engine then keeps and gathers it only in FP8 (its high-precision value
lives in the engine's fp32 main copy), as TransformerEngine's ``quantized_model_init`` does for
TE modules. On its own the module behaves the same either way.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from .gemm import fp8_gemm
from .quantizer import DelayedQuantizer, Quantizer
from .recipe import LinearQuantizers, Recipe
from .tensor import Fp8Tensor


class Float8WeightSlot:
    """The FP8 weight a sharding engine provides (``None`` when the module quantises its own).

    ``transposed()`` gives the (K, N) copy the input-grad GEMM needs; with ``keep_transpose``
    it is kept (one more full-size FP8 copy of the weight) until ``clear()``, else rebuilt.
    """

    def __init__(self) -> None:
        self.weight: Fp8Tensor | None = None
        self.keep_transpose = False
        self._transpose: Fp8Tensor | None = None

    def fill(self, weight: Fp8Tensor) -> None:
        self.weight = weight
        self._transpose = None

    def clear(self) -> None:
        self.weight = None
        self._transpose = None

    def release(self, keep_transpose: bool) -> None:
        """Drop the row-wise weight (its storage is about to be freed); with ``keep_transpose``
        a transposed copy built by the forward stays for the backward."""
        self.weight = None
        if not keep_transpose:
            self._transpose = None

    @property
    def has_transpose(self) -> bool:
        return self._transpose is not None

    def rowwise(self) -> Fp8Tensor | None:
        """The (N, K) weight for the forward GEMM; ``None`` when the slot holds nothing. After
        ``release(keep_transpose=True)`` only the transposed copy is left, and a forward that runs
        then (an activation recompute inside the backward) gets it transposed back: exact, the
        same bytes and scales (square or tensorwise blocks), so the recompute matches the forward."""
        if self.weight is not None:
            return self.weight
        return self._transpose.transpose() if self._transpose is not None else None

    def transposed(self) -> Fp8Tensor:
        if self._transpose is not None:
            return self._transpose
        if self.weight is None:
            raise RuntimeError("the FP8 weight slot is empty: the engine must gather the FP8 weight "
                               "before this module's forward and backward")
        transpose = self.weight.transpose()
        if self.keep_transpose:
            self._transpose = transpose
        return transpose


def _quantize_transposed(q: Quantizer, x2: torch.Tensor, rowwise: Fp8Tensor, tensorwise: bool) -> Fp8Tensor:
    """Operand for the weight-grad GEMM (contraction over tokens): the transposed bytes for a
    tensorwise recipe; a fresh (stateless, blockwise) quantisation of ``x2.T`` otherwise."""
    return rowwise.transpose() if tensorwise else q.quantize(x2.t())


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, quantizers: LinearQuantizers,
                tensorwise: bool, slot: Float8WeightSlot) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq = quantizers.input.quantize(x2)
        slot_weight = slot.rowwise()
        from_slot = slot_weight is not None
        wq = slot_weight if slot_weight is not None else quantizers.weight.quantize(weight.detach())
        y = fp8_gemm(xq, wq, x.dtype)
        if from_slot and slot.keep_transpose and ctx.needs_input_grad[0]:
            slot.transposed()  # built now and kept, so the backward needs no FP8 re-gather
        ctx.quantizers, ctx.tensorwise, ctx.from_slot, ctx.slot = quantizers, tensorwise, from_slot, slot
        ctx.x_shape, ctx.w_dtype, ctx.x_block, ctx.w_block = x.shape, weight.dtype, xq.block, wq.block
        x_for_wgrad = xq if tensorwise else quantizers.input.quantize(x2.t())
        ctx.xw_block = x_for_wgrad.block
        w_saved = (wq.data, wq.scale_inv) if not from_slot else (None, None)
        ctx.save_for_backward(x_for_wgrad.data, x_for_wgrad.scale_inv, *w_saved)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x_data, x_scale_inv, w_data, w_scale_inv = ctx.saved_tensors
        q: LinearQuantizers = ctx.quantizers
        dy2 = dy.reshape(-1, dy.shape[-1])
        dyq = q.grad_output.quantize(dy2)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            wt = ctx.slot.transposed() if ctx.from_slot else Fp8Tensor(w_data, w_scale_inv, ctx.w_block).transpose()
            dx = fp8_gemm(dyq, wt, dy.dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            xq = Fp8Tensor(x_data, x_scale_inv, ctx.xw_block)
            xt = xq.transpose() if ctx.tensorwise else xq  # saved already transposed when blockwise
            dyt = _quantize_transposed(q.grad_output, dy2, dyq, ctx.tensorwise)
            dw = fp8_gemm(dyt, xt, ctx.w_dtype)
        return dx, dw, None, None, None


class Float8Linear(nn.Linear):
    """``nn.Linear`` with FP8 GEMMs under ``recipe``; parameters are the usual high-precision ones."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None, *, recipe: Recipe, fp8_params: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._setup_fp8(recipe, fp8_params)

    def _setup_fp8(self, recipe: Recipe, fp8_params: bool) -> None:
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a fsdp_impl.fp8 recipe (CurrentScaling, DelayedScaling, "
                            f"BlockwiseScaling), got {type(recipe).__qualname__}")
        if not isinstance(fp8_params, bool):
            raise TypeError(f"fp8_params must be True or False, got {fp8_params!r}")
        recipe.check_linear(type(self).__qualname__, self.in_features, self.out_features)
        self.recipe = recipe
        self.fp8_params = fp8_params
        self.fp8_quantizers = recipe.make_quantizers(self)
        self.fp8_weight_slot = Float8WeightSlot()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: Recipe, fp8_params: bool = False) -> Float8Linear:
        """A ``Float8Linear`` sharing ``linear``'s parameter objects (optimizers keep working)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.register_parameter("bias", linear.bias)
        new.train(linear.training)
        new._setup_fp8(recipe, fp8_params)
        return new

    def reset_parameters(self) -> None:
        super().reset_parameters()
        quantizers: LinearQuantizers | None = getattr(self, "fp8_quantizers", None)  # None inside __init__
        for quantizer in quantizers.all() if quantizers is not None else []:
            if isinstance(quantizer, DelayedQuantizer):
                quantizer.reset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.fp8_params and self.fp8_weight_slot.rowwise() is None and self.weight.numel()
                and self.weight.untyped_storage().size() == 0):
            raise RuntimeError(f"{type(self).__name__}({self.in_features}, {self.out_features}) is an FP8 "
                               "parameter module whose sharding engine has not gathered its FP8 weight: it "
                               "ran outside its FSDP unit's forward and backward (call the unit, or gather "
                               "the module separately)")
        y = _Fp8LinearFn.apply(x, self.weight, self.fp8_quantizers, self.recipe.tensorwise, self.fp8_weight_slot)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}, fp8_params={self.fp8_params}"


def convert_to_fp8(model: nn.Module, recipe: Recipe,
                   module_filter: Callable[[str, nn.Module], bool] | None = None, *,
                   fp8_params: bool = False) -> nn.Module:
    """Swap every ``nn.Linear`` (exact type; subclasses are left alone) for a ``Float8Linear``
    sharing its parameters. ``module_filter(fqn, module)`` returning False keeps a layer;
    ``fp8_params=True`` makes the swapped weights FP8 parameters (see the module docstring).

    All layers are checked before any is swapped, so a bad shape leaves the model unchanged.
    Returns the model (a new module when ``model`` itself is an ``nn.Linear``).
    """
    if not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a fsdp_impl.fp8 recipe (CurrentScaling, DelayedScaling, "
                        f"BlockwiseScaling), got {type(recipe).__qualname__}; TransformerEngine recipes "
                        "go with TransformerEngine modules")
    targets = [(name, m) for name, m in model.named_modules()
               if type(m) is nn.Linear and (module_filter is None or module_filter(name, m))]
    for name, m in targets:
        recipe.check_linear(name or type(model).__qualname__, m.in_features, m.out_features)
    if not isinstance(fp8_params, bool):
        raise TypeError(f"fp8_params must be True or False, got {fp8_params!r}")
    if any(m is model for _, m in targets):
        return Float8Linear.from_linear(model, recipe, fp8_params)  # type: ignore[arg-type]
    parents = dict(model.named_modules())
    for name, m in targets:
        parent_name, _, attr = name.rpartition(".")
        setattr(parents[parent_name], attr, Float8Linear.from_linear(m, recipe, fp8_params))
    return model
