"""Scale arithmetic: amax -> scale, power-of-2 rounding, and per-block amax grids.

A scale multiplies a high-precision tensor into FP8 range (``q = cast(x * scale)``); its
reciprocal ``scale_inv`` turns FP8 values back (``x ~ q * scale_inv``), which is what GEMMs take.
A *block* ``(br, bc)`` of a 2-D tensor shares one scale; scales form a grid of shape
``(ceil(rows / br), ceil(cols / bc))`` (trailing partial blocks allowed). Tensorwise scaling is
the block that covers the whole tensor (grid ``(1, 1)``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .formats import fp8_max

Block = tuple[int, int]
_FP32_MAX = torch.finfo(torch.float32).max


def round_down_to_power_of_2(scale: torch.Tensor) -> torch.Tensor:
    """Largest power of two <= ``scale`` (exact: read from the float's exponent, no log2)."""
    _, exponent = torch.frexp(scale)  # scale = m * 2**exponent with m in [0.5, 1)
    return torch.ldexp(torch.ones_like(scale), exponent - 1)


def amax_to_scale(amax: torch.Tensor, dtype: torch.dtype, *, margin: int = 0, power_of_2: bool = False,
                  fallback: torch.Tensor | None = None) -> torch.Tensor:
    """``fp8_max / amax / 2**margin`` in fp32, elementwise over an amax grid.

    As TransformerEngine: an amax of 0, inf or NaN gives ``fallback`` (the previous scale for
    delayed scaling) or 1; a scale that overflows fp32 (tiny amax) becomes the fp32 max.
    """
    amax = amax.float()
    scale = torch.full_like(amax, fp8_max(dtype)) / amax
    if margin:
        scale = scale / float(2**margin)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FP32_MAX), scale)
    if power_of_2:
        scale = round_down_to_power_of_2(scale)
    keep = torch.ones_like(scale) if fallback is None else fallback.float().expand_as(scale)
    valid = (amax > 0) & torch.isfinite(amax)
    return torch.where(valid, scale, keep)


def resolve_block(shape: tuple[int, int], block: Block | None) -> Block:
    """The block of a 2-D tensor of ``shape``: ``None`` (tensorwise) covers the whole tensor."""
    if block is None:
        return (max(shape[0], 1), max(shape[1], 1))
    br, bc = block
    if br < 1 or bc < 1:
        raise ValueError(f"block sizes must be >= 1, got {block}")
    return (br, bc)


def grid_shape(shape: tuple[int, int], block: Block) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def block_amax(x: torch.Tensor, block: Block) -> torch.Tensor:
    """max(|x|) of every block of the 2-D ``x`` (fp32 grid; partial blocks are zero-padded,
    which cannot change a max of absolute values)."""
    rows, cols = x.shape
    grid = grid_shape((rows, cols), block)
    if grid[0] * grid[1] == 1 and rows * cols > 0:
        return x.abs().amax().float().reshape(1, 1)
    padded = F.pad(x.abs().float(), (0, grid[1] * block[1] - cols, 0, grid[0] * block[0] - rows))
    return padded.reshape(grid[0], block[0], grid[1], block[1]).amax(dim=(1, 3))


def expand_grid(grid: torch.Tensor, block: Block, shape: tuple[int, int]) -> torch.Tensor:
    """Per-element view of a block grid, broadcastable against a tensor of ``shape``."""
    if grid.numel() == 1:
        return grid.reshape(1, 1)
    full = grid.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]
