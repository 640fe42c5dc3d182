"""A CPU stand-in for the parts of TransformerEngine that the engine's FP8-parameter path uses.

``Float8Tensor`` (uint8 E4M3 bytes, a ``_scale_inv`` and a transpose cache, TE's
``get_high_precision_init_val`` protocol), a linear module computing with it, TE-style sharded
current-scaling quantisation and ``post_all_gather_processing``, plus the quantise-dequantise
reference linear. Shared by ``test_fp8_te_standin.py`` and ``test_fp8_te_host_work.py``.
"""
from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_impl.fp8 import E4M3, CurrentQuantizer


class Float8Tensor(torch.Tensor):
    """Stand-in for TE's Float8Tensor: a bf16-looking wrapper around uint8 E4M3 bytes."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # as TE: no subclass-wrapped results

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor) -> Float8Tensor:
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=torch.bfloat16, device=data.device)
        t._data, t._scale_inv = data, scale_inv
        t._transpose, t._transpose_invalid = None, True
        return t

    def dequantize(self) -> torch.Tensor:
        return (self._data.view(E4M3).float() * self._scale_inv).to(torch.bfloat16)

    def dequantize_transpose(self) -> torch.Tensor:
        """What a Hopper dgrad GEMM reads: the transposed bytes (built from ``_data`` if missing),
        returned in the weight's own (rows, cols) layout."""
        if self._transpose is None or self._transpose_invalid:
            self._transpose, self._transpose_invalid = self._data.t().contiguous(), False
        return (self._transpose.view(E4M3).float() * self._scale_inv).to(torch.bfloat16).t().contiguous()

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.detach.default:
            (src,) = args
            out = Float8Tensor(src._data, src._scale_inv)
            out._transpose, out._transpose_invalid = src._transpose, src._transpose_invalid
            return out
        raise NotImplementedError(f"stand-in Float8Tensor does not implement {func}")


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: Float8Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x @ weight.dequantize().t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        dx = dy @ weight.dequantize_transpose()
        dw = (x.reshape(-1, x.shape[-1]).t() @ dy.reshape(-1, dy.shape[-1])).t()  # as autograd's mm backward
        return dx, dw


class TeLinear(nn.Module):
    """Stand-in TE linear: FP8 weight (from a bf16 init, preserved as TE does), bf16 bias."""

    def __init__(self, source: nn.Linear) -> None:
        super().__init__()
        w = source.weight.detach()
        q = CurrentQuantizer(E4M3).quantize(w)
        param = nn.Parameter(Float8Tensor(q.data.view(torch.uint8).clone(), q.scale_inv.reshape(())))
        hp = w.clone().cpu()
        param.get_high_precision_init_val = lambda: hp
        param.clear_high_precision_init_val = lambda: None
        self.weight = param
        self.bias = source.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight) + self.bias


def quantize_master_weights(model_weights: list, master_weights: list, start_offsets: list, group: Any,
                            fsdp_shard_model_weights: list, manual_post_all_gather_processing: bool) -> None:
    """Current scaling as TE does it: bf16 cast of the master rows, partial amaxes, one MAX
    all-reduce, local casts into the shard's bytes, replicated scale_inv."""
    amax = torch.zeros(len(model_weights), device=model_weights[0].device)
    for i, master in enumerate(master_weights):
        if master is not None:
            amax[i] = master.to(torch.bfloat16).abs().amax().float()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    quantizer = CurrentQuantizer(E4M3)
    for i, (weight, master, shard) in enumerate(zip(model_weights, master_weights, fsdp_shard_model_weights,
                                                    strict=True)):
        scale = quantizer.scale_for(amax[i].reshape(1, 1))
        weight._scale_inv = torch.reciprocal(scale).reshape(())
        if master is not None:
            q = (master.to(torch.bfloat16).float() * scale.reshape(())).clamp(-448, 448).to(E4M3)
            shard.copy_(q.view(torch.uint8))


def post_all_gather_processing(weights: Float8Tensor | list[Float8Tensor]) -> None:
    """As TE's: one weight or a list of them."""
    for weight in weights if isinstance(weights, list) else [weights]:
        weight._transpose, weight._transpose_invalid = weight._data.t().contiguous(), False


TE_MODULES = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.quantized_tensor",
              "transformer_engine.pytorch.tensor", "transformer_engine.pytorch.tensor.utils")


def stand_in_modules(names: tuple[str, ...] = TE_MODULES) -> dict[str, Any]:
    """Empty modules under TE's names, with the stand-in's ``QuantizedTensor`` and the two
    ``tensor.utils`` functions filled in (callers add more, then put them in ``sys.modules``)."""
    mods: dict[str, Any] = {n: types.ModuleType(n) for n in (*TE_MODULES, *names)}
    mods["transformer_engine.pytorch.quantized_tensor"].QuantizedTensor = Float8Tensor
    utils = mods["transformer_engine.pytorch.tensor.utils"]
    utils.quantize_master_weights = quantize_master_weights
    utils.post_all_gather_processing = post_all_gather_processing
    return mods


class _QdqFn(torch.autograd.Function):
    """Reference: quantise-dequantise the bf16 weight (current scaling), straight-through grad."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor) -> torch.Tensor:
        return CurrentQuantizer(E4M3).quantize(w).dequantize(torch.bfloat16)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return g


class QdqLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ _QdqFn.apply(self.weight).t() + self.bias


def swap(model: nn.Module, make: Any) -> nn.Module:
    for block in model.blocks:
        for name in ("fc1", "fc2"):
            setattr(block, name, make(getattr(block, name)))
    return model


def qdq(linear: nn.Linear) -> QdqLinear:
    new = QdqLinear(linear.in_features, linear.out_features, dtype=linear.weight.dtype)
    new.load_state_dict(linear.state_dict())
    return new
