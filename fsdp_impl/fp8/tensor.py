"""``Fp8Tensor``: FP8 data plus the block scales needed to read it back.

A plain state object (not a tensor subclass): a 2-D float8 ``data`` tensor laid out with the
GEMM contraction dim last, ``scale_inv`` (one fp32 value per block) and the block shape. Module
code and the sharding engine pass it around explicitly; nothing is hidden behind a ``Parameter``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import check_fp8_dtype, saturating_cast
from .scaling import Block, block_amax, expand_grid, grid_shape, resolve_block


@dataclass
class Fp8Tensor:
    data: torch.Tensor  # float8, 2-D
    scale_inv: torch.Tensor  # fp32 grid (ceil(rows / block[0]), ceil(cols / block[1]))
    block: Block

    @property
    def shape(self) -> tuple[int, int]:
        return (self.data.shape[0], self.data.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def tensorwise(self) -> bool:
        return self.scale_inv.numel() == 1 and self.block == resolve_block(self.shape, None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``data * scale_inv`` in fp32, then cast to ``dtype``."""
        values = self.data.float() * expand_grid(self.scale_inv, self.block, self.shape)
        return values.to(dtype)

    def transpose(self) -> Fp8Tensor:
        """The same values transposed into a new contiguous tensor (the "transpose cache" a
        Hopper GEMM needs for the other contraction dim); block scales transpose with it."""
        return Fp8Tensor(self.data.t().contiguous(), self.scale_inv.t().contiguous(),
                         (self.block[1], self.block[0]))


def cast_with_scale(x: torch.Tensor, scale: torch.Tensor, block: Block, dtype: torch.dtype) -> torch.Tensor:
    """``saturating_cast(x * scale)`` with one scale per block; fp32 multiply, as TE and torchao."""
    check_fp8_dtype(dtype)
    shape = (x.shape[0], x.shape[1])
    return saturating_cast(x.float() * expand_grid(scale, block, shape), dtype)


def quantize_with_scale(x: torch.Tensor, scale: torch.Tensor, block: Block | None, dtype: torch.dtype) -> Fp8Tensor:
    """Quantise the 2-D ``x`` with given per-block ``scale`` (grid shaped)."""
    if x.dim() != 2:
        raise ValueError(f"FP8 quantisation takes 2-D tensors, got shape {tuple(x.shape)}")
    resolved = resolve_block((x.shape[0], x.shape[1]), block)
    expected = grid_shape((x.shape[0], x.shape[1]), resolved)
    scale = scale.float().reshape(expected) if scale.numel() == expected[0] * expected[1] else scale
    if tuple(scale.shape) != expected:
        raise ValueError(f"scale grid {tuple(scale.shape)} does not match blocks {resolved} of a "
                         f"{tuple(x.shape)} tensor (expected {expected})")
    return Fp8Tensor(cast_with_scale(x, scale, resolved, dtype), torch.reciprocal(scale), resolved)


def amax_of(x: torch.Tensor, block: Block | None) -> torch.Tensor:
    """Block amax grid of the 2-D ``x`` (``None``: one amax, grid (1, 1))."""
    return block_amax(x, resolve_block((x.shape[0], x.shape[1]), block))
