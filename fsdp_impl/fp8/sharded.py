"""Sharded quantisation: every rank quantises only its row shard of each FP8 weight, and the
concatenated shards are bit-identical to quantising the full tensor.

Per weight, a rank computes the amax grid of the blocks its rows touch (the other blocks stay
0), all of a step's grids are packed into one fp32 buffer, one MAX all-reduce over the shard
group makes them the full tensors' amaxes on every rank, the weight quantizer turns them into
scales (identical everywhere), and each rank casts its rows with the scale of the block each
row falls in. A block split across two ranks (rows not a multiple of the block height) gets the
same scale on both, so the gathered bytes need no fix-up; scales are replicated by the
all-reduce, so only the FP8 bytes travel in the all-gather.

``ShardedQuantization`` holds no process group: the caller runs the all-reduce on
``amax_buffer()`` (``comm.all_reduce_max``), then calls ``finish``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import saturating_cast
from .quantizer import Quantizer
from .scaling import Block, block_amax, expand_grid, grid_shape, resolve_block


def partial_amax(shard: torch.Tensor, full_shape: tuple[int, int], row_start: int, block: Block) -> torch.Tensor:
    """Amax grid of the full tensor's blocks, from rows ``[row_start, row_start + len(shard))``."""
    grid = torch.zeros(grid_shape(full_shape, block), dtype=torch.float32, device=shard.device)
    if shard.shape[0] == 0:
        return grid
    lead = row_start % block[0]  # rows of the first touched block that belong to an earlier rank
    padded = torch.cat([shard.new_zeros(lead, shard.shape[1]), shard]) if lead else shard
    local = block_amax(padded, block)
    first = row_start // block[0]
    grid[first: first + local.shape[0]] = local
    return grid


def cast_shard(shard: torch.Tensor, scale: torch.Tensor, full_shape: tuple[int, int], row_start: int,
               block: Block, dtype: torch.dtype) -> torch.Tensor:
    """FP8 bytes of rows ``[row_start, ...)`` cast with the full tensor's ``scale`` grid."""
    rows = shard.shape[0]
    per_element = expand_grid(scale, block, full_shape)
    if per_element.shape[0] != 1:
        per_element = per_element[row_start: row_start + rows]
    return saturating_cast(shard.float() * per_element, dtype)


@dataclass
class ShardedWeight:
    """One FP8 weight's shard on this rank (2-D, rows ``[row_start, row_start + len(shard))``)."""

    quantizer: Quantizer
    shard: torch.Tensor  # high precision, already in the compute dtype
    full_shape: tuple[int, int]
    row_start: int

    @property
    def block(self) -> Block:
        return resolve_block(self.full_shape, self.quantizer.block)


@dataclass
class QuantizedShard:
    data: torch.Tensor  # float8 rows of this rank
    scale_inv: torch.Tensor  # the full tensor's grid (same on every rank)
    block: Block


class ShardedQuantization:
    """Quantise many weight shards with one amax reduction (see the module docstring)."""

    def __init__(self, weights: list[ShardedWeight]) -> None:
        self.weights = weights
        self._sizes = [grid_shape(w.full_shape, w.block) for w in weights]

    def amax_buffer(self) -> torch.Tensor:
        """This rank's partial amaxes of every weight, packed in list order (MAX-reduce it)."""
        parts = [partial_amax(w.shard, w.full_shape, w.row_start, w.block).reshape(-1) for w in self.weights]
        if not parts:
            return torch.zeros(0)
        return torch.cat(parts)

    def finish(self, reduced: torch.Tensor) -> list[QuantizedShard]:
        """Scales from the reduced amaxes (advancing delayed-scaling state), then local casts."""
        out, offset = [], 0
        for w, (gr, gc) in zip(self.weights, self._sizes, strict=True):
            amax = reduced[offset: offset + gr * gc].reshape(gr, gc)
            offset += gr * gc
            scale = w.quantizer.scale_for(amax)
            data = cast_shard(w.shard, scale, w.full_shape, w.row_start, w.block, w.quantizer.dtype)
            out.append(QuantizedShard(data, torch.reciprocal(scale), w.block))
        return out
